"""One KV tier: block files in a directory, shared by every worker of one layout on the host.

    <root>/<scope>/<block hash>.kv      scope: a digest of the cache salt (a tenant's own, or "shared")
    <root>/<scope>/.<name>.<pid>.<n>.tmp   a block being written; renamed into place whole, so a reader sees a
                                            complete file or none, and a writer killed mid-write leaves only this

The filesystem is the index between processes: a put is a rename, a get is an open, an eviction an unlink, each
atomic, so concurrent workers need no lock and no shared memory segment. On tmpfs (``/dev/shm``) the tier is host
memory; on a disk it is the disk tier. Each process keeps its own view of the files (sizes, reuse) to choose what
to evict, rescanned now and then to see the others' writes and evictions; two workers may both count a file for a
moment, so a tier can overshoot its capacity by what one rescan interval writes.

Eviction is least-recently-used weighted by reuse: a block read k times counts as used ``reuse_credit_s *
log2(1 + k)`` seconds later than it was. A scope holds at most ``scope_share`` of the capacity, so one tenant's
burst evicts that tenant's own blocks rather than flushing everyone's.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("switchyard.kv_tiers")

_SUFFIX = ".kv"
_LOW_WATERMARK = 0.95  # evict down to this fraction of a limit, so evictions come in batches, not one per put


class TierFull(OSError):
    """The tier's filesystem refused a write (no space, a file size limit, the directory gone)."""


def scope_dir(salt: str) -> str:
    """The directory of one cache salt's blocks: a digest, so a path never shows a tenant id."""
    return hashlib.blake2b(salt.encode(), digest_size=8).hexdigest()


@dataclass(slots=True)
class _Entry:
    scope: str  # scope_dir of the salt
    size: int
    last_use: float
    hits: int = 0


@dataclass(slots=True)
class TierCounters:
    """What a tier did since start (per process)."""

    hits: int = 0  # blocks read back
    misses: int = 0  # blocks looked up and not here
    stores: int = 0  # blocks written
    evictions: int = 0  # blocks removed for room (demoted to the next tier when there is one)
    corrupt: int = 0  # blocks that failed their checks on read, and were removed
    write_errors: int = 0  # writes the filesystem refused (full, gone): the block is simply not kept


class FileTier:
    """A directory of block files with a byte capacity; thread-safe within a process, lock-free between them."""

    def __init__(self, name: str, root: Path, capacity_bytes: int, scope_share: float = 0.5,
                 reuse_credit_s: float = 30.0, rescan_s: float = 10.0,
                 demote: Callable[[int, str, bytes], None] | None = None, record_events: bool = False) -> None:
        """``demote(block_hash, scope, data)`` receives each block evicted for room (the next tier's put);
        ``record_events``: keep what this process writes and removes for ``take_events``."""
        if capacity_bytes <= 0:
            raise ValueError(f"tier {name}: capacity must be positive, got {capacity_bytes}")
        self.name = name
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.scope_cap_bytes = int(capacity_bytes * scope_share)
        self._reuse_credit_s = reuse_credit_s
        self._rescan_s = rescan_s
        self._demote = demote
        self._lock = threading.RLock()
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._scope_bytes: dict[str, int] = {}
        self._total = 0
        self._tmp_names = itertools.count()
        self._last_scan = 0.0
        self._last_warning = 0.0
        self.counters = TierCounters()
        # KV events: what this process wrote and removed since take_events (None: not recorded).
        self._stored: list[int] | None = [] if record_events else None
        self._removed: list[int] | None = [] if record_events else None
        root.mkdir(parents=True, exist_ok=True)
        self.rescan()

    # -- what it holds ------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._total

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def path(self, scope: str, block_hash: int) -> Path:
        return self.root / scope / f"{block_hash:032x}{_SUFFIX}"

    def contains(self, scope: str, block_hash: int) -> bool:
        with self._lock:
            if (scope, block_hash) in self._entries:
                return True
        return self.path(scope, block_hash).exists()  # another worker's, written since the last rescan

    # -- reads and writes ---------------------------------------------------------------------------------
    def get(self, scope: str, block_hash: int) -> bytearray | None:
        """The file's bytes (writable, so tensors can be made over them without a copy), or None when no worker
        holds it (a concurrent eviction is a miss too)."""
        path = self.path(scope, block_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                if (n := f.readinto(data)) < len(data):
                    del data[n:]  # truncated since the stat: decode_block finds it short
        except (FileNotFoundError, NotADirectoryError):
            with self._lock:
                self.counters.misses += 1
                self._forget((scope, block_hash))
            return None
        except OSError as exc:
            self.warn(f"read of {path} failed: {exc!r}")
            with self._lock:
                self.counters.misses += 1
            return None
        with self._lock:
            self.counters.hits += 1
            entry = self._entries.get((scope, block_hash))
            if entry is None:
                entry = self._add((scope, block_hash), len(data), time.time())
            entry.hits += 1
            entry.last_use = time.time()
        return data

    def put(self, scope: str, block_hash: int, data: bytes | tuple[bytes | memoryview, ...]) -> bool:
        """Write a block unless some worker holds it already; False when it was not written. Raises ``TierFull``
        when the filesystem refuses the write (the caller counts it and goes on without the block)."""
        key = (scope, block_hash)
        path = self.path(scope, block_hash)
        with self._lock:
            if key in self._entries:
                self._entries[key].last_use = time.time()
                return False
            if time.monotonic() - self._last_scan > self._rescan_s:
                self.rescan()
            if path.exists():
                self._add(key, path.stat().st_size, time.time())
                return False
            parts = (data,) if isinstance(data, bytes) else data
            size = sum(len(part) for part in parts)
            self._make_room(scope, size)
            tmp = path.parent / f".{path.stem}.{os.getpid()}.{next(self._tmp_names)}.tmp"
            try:
                path.parent.mkdir(exist_ok=True)
                with open(tmp, "wb", buffering=0) as f:
                    for part in parts:
                        _write_all(f, part)
                os.replace(tmp, path)
            except OSError as exc:
                self.counters.write_errors += 1
                _unlink(tmp)
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOTDIR, errno.ENOENT):
                    raise TierFull(exc.errno, f"tier {self.name}: {exc.strerror}") from exc
                raise
            self._add(key, size, time.time())
            self.counters.stores += 1
            if self._stored is not None:
                self._stored.append(block_hash)
            return True

    def remove_corrupt(self, scope: str, block_hash: int) -> None:
        """A block that failed its checks: removed, so no worker reads it again."""
        with self._lock:
            self.counters.corrupt += 1
            _unlink(self.path(scope, block_hash))
            self._forget((scope, block_hash))
            if self._removed is not None:
                self._removed.append(block_hash)

    def take_events(self) -> tuple[list[int], list[int]]:
        """The blocks this process wrote and removed since the last call (other workers publish their own)."""
        with self._lock:
            if self._stored is None or self._removed is None:
                return [], []
            stored, removed = self._stored, self._removed
            self._stored, self._removed = [], []
        return stored, removed

    def listing(self) -> list[int]:
        """Every block this process knows the tier holds (its last rescan and its own writes since)."""
        with self._lock:
            return [block_hash for _, block_hash in self._entries]

    # -- room ---------------------------------------------------------------------------------------------
    def rescan(self) -> None:
        """Re-read which blocks the directory holds (every worker's), keeping this process's reuse counts."""
        with self._lock:
            seen: dict[tuple[str, int], _Entry] = {}
            for scope_entry in _scandir(self.root):
                if not scope_entry.is_dir() or scope_entry.name.startswith("."):
                    continue
                for entry in _scandir(Path(scope_entry.path)):
                    if not entry.name.endswith(_SUFFIX):
                        continue
                    try:
                        key = (scope_entry.name, int(entry.name[:-len(_SUFFIX)], 16))
                        stat = entry.stat()
                    except (ValueError, OSError):
                        continue
                    known = self._entries.get(key)
                    seen[key] = known or _Entry(key[0], stat.st_size, stat.st_mtime)
            self._entries = seen
            self._scope_bytes = {}
            for e in seen.values():
                self._scope_bytes[e.scope] = self._scope_bytes.get(e.scope, 0) + e.size
            self._total = sum(self._scope_bytes.values())
            self._last_scan = time.monotonic()

    def _make_room(self, scope: str, size: int) -> None:
        if self._scope_bytes.get(scope, 0) + size > self.scope_cap_bytes:
            self._evict_down_to(int(self.scope_cap_bytes * _LOW_WATERMARK) - size, scope)
        if self._total + size > self.capacity_bytes:
            self._evict_down_to(int(self.capacity_bytes * _LOW_WATERMARK) - size, None)

    def _evict_down_to(self, target: int, scope: str | None) -> None:
        """Evict the least valuable blocks (of ``scope``, or of all) until their bytes are at most ``target``."""
        def used() -> int:
            return self._total if scope is None else self._scope_bytes.get(scope, 0)

        candidates = [(k, e) for k, e in self._entries.items() if scope is None or e.scope == scope]
        candidates.sort(key=lambda ke: ke[1].last_use + self._reuse_credit_s * math.log2(1 + ke[1].hits))
        for key, _entry in candidates:
            if used() <= max(0, target):
                break
            self._evict(key)

    def _evict(self, key: tuple[str, int]) -> None:
        path = self.path(*key)
        if self._demote is not None:
            try:
                data = path.read_bytes()
            except OSError:
                data = None  # another worker evicted it first
            if data is not None:
                try:
                    self._demote(key[1], key[0], data)
                except Exception as exc:  # the next tier full or gone: the block is dropped, as with no next tier
                    self.warn(f"demoting a block from {self.name} failed: {exc!r}")
        _unlink(path)
        self._forget(key)
        if self._removed is not None:
            self._removed.append(key[1])
        self.counters.evictions += 1

    def _add(self, key: tuple[str, int], size: int, now: float) -> _Entry:
        entry = self._entries[key] = _Entry(key[0], size, now)
        self._scope_bytes[key[0]] = self._scope_bytes.get(key[0], 0) + size
        self._total += size
        return entry

    def _forget(self, key: tuple[str, int]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._scope_bytes[entry.scope] -= entry.size
            self._total -= entry.size

    def warn(self, message: str) -> None:
        """Log a tier's trouble at most once a minute (a full disk fails every write)."""
        now = time.monotonic()
        if now - self._last_warning > 60:
            self._last_warning = now
            log.warning("KV tier %s: %s", self.name, message)


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _write_all(f, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
