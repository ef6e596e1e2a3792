"""Credentials of the embedded servers: generated once, kept in the data dir readable by its owner only, and
handed to each process through its environment (``SWITCHYARD_NATS_URL``, ``SWITCHYARD_DATABASE_URL``), never on a
command line.

NATS gets one user per role, each allowed only the subjects its processes use (nothing anonymous):

    role      publishes                                              subscribes
    gateway   llm.req.> llm.aff.> llm.cancel.> llm.events.>          llm.tok.> llm.alive.> llm.kv.> (KV events)
              llm.kvsnap.> llm.usage llm.held.> llm.dead.>           (and hosts the jobs: billing, batches)
              llm.gw.alive.> llm.resume.> (streams taken over)
    worker    llm.tok.> llm.usage llm.result.> llm.alive.> llm.kv.>  llm.req.> llm.aff.> (doorbells) llm.cancel.>
              llm.kvblk.> (other nodes' KV blocks)                   llm.kvsnap.> (snapshot requests) llm.kvblk.>
                                                                     llm.gw.alive.> llm.resume.> (streams taken over)
    admin     everything (the CLI: tiers, tenants, usage)

Neither service role holds the JetStream API (``$JS.API.>``): each may create the streams and buckets it sets up
(by name; creating one that exists changes nothing), read stream info, and create, read and pull from the consumers
of the streams it consumes, and ack those streams' messages only. So a worker can take requests and publish usage,
but cannot purge, delete, reconfigure or consume the USAGE stream, nor write the tier policies; no service role can
purge or delete a stream (the gateway may delete the pre-tier REQUESTS stream only, and a batch line's message).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from switchyard.shared.tiers import TIER_NAMES

SECRETS_FILE = "secrets.json"
NATS_CONFIG_FILE = "nats-auth.conf"
ROLES = ("gateway", "worker", "admin")

_API = "$JS.API"
# Every stream and bucket ``shared/jetstream.ensure_streams`` makes: created by whichever process starts first.
_TIER_STREAMS = [f"REQUESTS_{tier.upper()}" for tier in TIER_NAMES]
_STREAMS = [*_TIER_STREAMS, "USAGE", "EVENTS", "BATCH_RESULTS", "HELD_WRITES", "DEAD_LETTERS", "AFFINITY",
            "KV_tiers", "KV_workers"]


def _consumes(*streams: str) -> list[str]:
    """Creating, reading and pulling from the consumers of ``streams``, and acking their messages."""
    return [subject for stream in streams for subject in (
        f"{_API}.CONSUMER.CREATE.{stream}.>", f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{_API}.CONSUMER.INFO.{stream}.*", f"{_API}.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.>")]


def _reads_buckets(*buckets: str) -> list[str]:
    return [subject for bucket in buckets for subject in (
        f"{_API}.DIRECT.GET.KV_{bucket}", f"{_API}.DIRECT.GET.KV_{bucket}.>", f"{_API}.STREAM.MSG.GET.KV_{bucket}")]


_SETUP = [f"{_API}.INFO", f"{_API}.STREAM.NAMES", f"{_API}.STREAM.INFO.*",
          *(f"{_API}.STREAM.CREATE.{name}" for name in _STREAMS), "_INBOX.>"]
PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "gateway": {  # the gateways and the jobs (billing writer, batch runner, housekeeping)
        "publish": ["llm.req.>", "llm.aff.>", "llm.cancel.>", "llm.events.>", "llm.kvsnap.>", "llm.usage",
                    "llm.held.>", "llm.dead.>", "llm.gw.alive.>", "llm.resume.>", "$KV.tiers.>", "$KV.affinity.>",
                    *_SETUP,
                    f"{_API}.STREAM.CREATE.KV_affinity",
                    *(f"{_API}.STREAM.UPDATE.{name}" for name in _TIER_STREAMS),  # the tiers' queue caps
                    f"{_API}.STREAM.UPDATE.AFFINITY",  # its consumer limit (shared/jetstream.py)
                    # Queue gauges (oldest request, backlog), billing lag, batch lines: read by sequence.
                    *(f"{_API}.STREAM.MSG.GET.{name}" for name in (*_TIER_STREAMS, "USAGE")),
                    f"{_API}.STREAM.DELETE.REQUESTS", f"{_API}.STREAM.MSG.DELETE.REQUESTS_BATCH",
                    *_consumes("USAGE", "HELD_WRITES", "BATCH_RESULTS"),
                    *_reads_buckets("tiers", "workers", "affinity")],
        "subscribe": ["llm.tok.>", "llm.alive.>", "llm.kv.>", "_INBOX.>"],
    },
    "worker": {
        "publish": ["llm.tok.>", "llm.usage", "llm.result.>", "llm.alive.>", "llm.kv.>", "llm.kvblk.>",
                    "$KV.workers.>", *_SETUP,
                    *_consumes(*_TIER_STREAMS, "AFFINITY"), *_reads_buckets("tiers", "workers")],
        "subscribe": ["llm.req.>", "llm.aff.>", "llm.cancel.>", "llm.kvsnap.>", "llm.kvblk.>", "llm.gw.alive.>",
                      "llm.resume.>", "_INBOX.>"],
    },
    "admin": {"publish": [">"], "subscribe": [">"]},
}


@dataclass(frozen=True)
class Secrets:
    postgres_password: str  # the superuser's: migrations only
    nats_passwords: dict[str, str]  # role -> password
    app_password: str = ""  # the services' Postgres role (deploy/db_roles.py)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by its owner only (created so: never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def load_or_create(data_dir: Path) -> Secrets:
    """The data dir's secrets, generated on the first start and kept (mode 0600) for the next ones."""
    path = data_dir / SECRETS_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        found = Secrets(stored["postgres_password"], stored["nats_passwords"], stored.get("app_password", ""))
        if set(found.nats_passwords) >= set(ROLES) and found.app_password:
            return found
        if set(found.nats_passwords) >= set(ROLES):  # from before the app role: the cluster keeps its superuser
            found = Secrets(found.postgres_password, found.nats_passwords, secrets.token_urlsafe(24))
            write_private(path, json.dumps(asdict(found)))
            return found
    found = Secrets(secrets.token_urlsafe(24), {role: secrets.token_urlsafe(24) for role in ROLES},
                    secrets.token_urlsafe(24))
    data_dir.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(asdict(found)))
    return found


def permissions_conf() -> str:
    """The service roles' permissions as nats-server variables (``GATEWAY_PERMISSIONS``, ``WORKER_PERMISSIONS``),
    the text of deploy/nats/permissions.conf, which compose's servers include (tests/deploy keeps it current)."""
    lines = ["# Generated from deploy/credentials.py PERMISSIONS (tests/deploy/test_compose.py fails when it differs)."]
    for role in ("gateway", "worker"):
        perms = PERMISSIONS[role]
        lines.append(f"{role.upper()}_PERMISSIONS: {{\n  publish: {json.dumps(perms['publish'])}\n"
                     f"  subscribe: {json.dumps(perms['subscribe'])}\n}}")
    return "\n".join(lines) + "\n"


def write_nats_config(path: Path, creds: Secrets, tls_cert: Path | None = None, tls_key: Path | None = None) -> Path:
    """The nats-server configuration of the users and their permissions (mode 0600), and TLS when a certificate
    and key are given (clients must then connect with tls:// URLs)."""
    users = []
    for role in ROLES:
        perms = PERMISSIONS[role]
        users.append(f"    {{user: {role}, password: {json.dumps(creds.nats_passwords[role])}, permissions: {{"
                     f"publish: {json.dumps(perms['publish'])}, subscribe: {json.dumps(perms['subscribe'])}}}}}")
    text = "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"
    if tls_cert is not None and tls_key is not None:
        text += f"tls {{\n  cert_file: {json.dumps(str(tls_cert))}\n  key_file: {json.dumps(str(tls_key))}\n}}\n"
    write_private(path, text)
    return path


def with_credentials(url: str, user: str, password: str, scheme: str | None = None) -> str:
    """``url`` (one server or a comma-separated list) with ``user:password@`` on every server (and ``scheme``,
    e.g. ``tls``, when given)."""
    def one(server: str) -> str:
        parts = urlsplit(server.strip())
        host = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit(parts._replace(scheme=scheme or parts.scheme, netloc=f"{user}:{password}@{host}"))
    return ",".join(one(s) for s in url.split(","))


def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and banners."""
    def one(server: str) -> str:
        parts = urlsplit(server.strip())
        if "@" not in parts.netloc:
            return server.strip()
        userinfo, host = parts.netloc.rsplit("@", 1)
        return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))
    return ",".join(one(s) for s in url.split(","))
