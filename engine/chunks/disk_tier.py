"""Disk tier of the chunk KV store: chunk bodies' KV cache, kept across restarts.

One file per chunk entry, under ``root / <fingerprint id>/<key hex>.kv``, where the fingerprint
id is a short BLAKE2b of the model / KV-layout fingerprint, so engines with another model,
dtype or block size never see each other's files.

File format (all integers little-endian)::

    offset 0    magic         4 bytes  b"PRKV"
    offset 4    version       u32      FORMAT_VERSION
    offset 8    header_len    u32      length of the JSON header that follows
    offset 12   header        header_len bytes of UTF-8 JSON, space-padded so that the payload
                              starts at a multiple of 64 bytes:
                              {"key": hex, "fingerprint": {...}, "namespace": str,
                               "token_ids": [int], "base_pos": int, "tags": [str],
                               "dtype": "bfloat16", "shape": [layers, tokens, kv_heads, head_dim],
                               "payload_len": int}
    offset 12+header_len      payload      k's bytes then v's bytes, raw, in the machine's
                              (little-endian) byte order, each ``shape`` of ``dtype``, contiguous
    last 32 bytes             BLAKE2b-256 digest of everything before it

A file is written to a temp file in the same directory, fsynced and renamed over its final name,
so a reader (or a restart after a crash) sees a whole old file, a whole new one, or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

MAGIC = b"PRKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sII")  # magic, version, header length
_DIGEST_BYTES = 32
# The payload starts 64-byte aligned, so k and v can be dtype views over the read buffer.
_ALIGN = 64
# Far above any real header (a chunk's token ids); a bigger length means a garbled prefix.
_MAX_HEADER_BYTES = 64 << 20
_MAX_KEY_BYTES = 64
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int8",
        "uint8",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}

# The payload is written in pieces of this many bytes, calling _piece_hook after each one; tests
# shrink the pieces and use the hook to stall a write (and kill the process in the middle of it).
_PIECE_BYTES = 8 << 20
_piece_hook: Callable[[], None] | None = None


class _CorruptError(Exception):
    """A file that does not parse or does not verify."""


@dataclass(frozen=True, slots=True)
class _Header:
    """What a file's JSON header says: who owns the entry and the layout of its payload."""

    key: bytes
    fingerprint: dict[str, str | int]
    namespace: str
    token_ids: tuple[int, ...]
    base_pos: int
    tags: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, int, int, int]

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def payload_len(self) -> int:
        return 2 * self.tensor_bytes

    def encode(self) -> bytes:
        """Magic, version, header length and the padded JSON header: all before the payload."""
        body = json.dumps(
            {
                "key": self.key.hex(),
                "fingerprint": self.fingerprint,
                "namespace": self.namespace,
                "token_ids": list(self.token_ids),
                "base_pos": self.base_pos,
                "tags": list(self.tags),
                "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape),
                "payload_len": self.payload_len,
            },
            separators=(",", ":"),
        ).encode()
        body += b" " * (-(_PREFIX.size + len(body)) % _ALIGN)
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body

    @classmethod
    def decode(cls, raw: bytes) -> _Header:
        """Parse and type-check a JSON header; raises _CorruptError."""
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise _CorruptError("header is not a JSON object")
            shape = tuple(_ints(obj["shape"]))
            dtype = _DTYPES.get(obj["dtype"])
            header = cls(
                key=bytes.fromhex(_typed(obj["key"], str)),
                fingerprint=_typed(obj["fingerprint"], dict),
                namespace=_typed(obj["namespace"], str),
                token_ids=tuple(_ints(obj["token_ids"])),
                base_pos=_typed(obj["base_pos"], int),
                tags=tuple(_typed(tag, str) for tag in _typed(obj["tags"], list)),
                dtype=dtype,  # type: ignore[arg-type]  # checked just below
                shape=shape,  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise _CorruptError(f"bad header: {exc!r}") from None
        if dtype is None or len(shape) != 4 or min(shape) < 0:
            raise _CorruptError(f"bad dtype or shape: {obj['dtype']!r} {shape}")
        if len(header.token_ids) != shape[1] or obj["payload_len"] != header.payload_len:
            raise _CorruptError("token count or payload length disagrees with the shape")
        return header


def _typed(value: Any, kind: type) -> Any:
    # `type(...) is` keeps JSON booleans out of int fields
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _ints(value: Any) -> list[int]:
    return [_typed(item, int) for item in _typed(value, list)]


@dataclass(slots=True)
class _Entry:
    """The in-memory index's view of one file: enough for eviction and drop_tag."""

    namespace: str
    tags: frozenset[str]
    size: int


@dataclass(eq=False, slots=True)
class _Job:
    """One write; `reserved` is what it counts against the queue's byte budget."""

    header: _Header
    k: torch.Tensor
    v: torch.Tensor
    size: int
    reserved: int = 0
    cancelled: bool = False


class DiskTier:
    """Chunk KV entries stored as files under ``root``, bounded by ``max_bytes`` (LRU).

    With ``background=True``, put() hands the write to one daemon writer thread and returns at
    once; a write that would push the queued bytes over ``max_queue_bytes`` is dropped and
    counted in ``dropped_writes`` instead of waiting. Call close() at shutdown: writes still
    queued when the process exits are lost (their temp files are removed at the next start).

    One process per directory: construction deletes every temp file it finds there, which would
    break another live writer's write.
    """

    def __init__(
        self,
        root: Path,
        *,
        fingerprint: Mapping[str, str | int],
        max_bytes: int,
        background: bool = True,
        max_queue_bytes: int = 256 << 20,
    ) -> None:
        self._fingerprint = _normalize_fingerprint(fingerprint)
        self.path = Path(root) / fingerprint_id(self._fingerprint)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_queue_bytes = max_queue_bytes
        self._lock = threading.Lock()
        # key -> entry, least recently used first
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._pending: set[_Job] = set()
        self._queued_bytes = 0
        self._closed = False
        self.writes = 0
        self.dropped_writes = 0
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self._load_index()
        with self._lock:
            self._evict_locked()
        self._queue: queue.Queue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(
                target=self._writer_loop, name="chunk-disk-writer", daemon=True
            )
            self._thread.start()

    # -- public API ---------------------------------------------------------------------------

    @property
    def num_files(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        """The counters, read together."""
        with self._lock:
            return {
                "num_files": len(self._index),
                "bytes": self._bytes,
                "writes": self.writes,
                "dropped_writes": self.dropped_writes,
                "hits": self.hits,
                "misses": self.misses,
                "corrupt": self.corrupt,
            }

    def put(
        self,
        key: bytes,
        namespace: str,
        token_ids: Sequence[int],
        base_pos: int,
        tags: Iterable[str],
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        copy: bool = True,
    ) -> None:
        """Store an entry (replacing any with the same key); k, v: CPU [layers, tokens, heads,
        head_dim]. In background mode the tier clones k and v before returning, so the caller
        may reuse them; pass ``copy=False`` to hand them over instead (the caller then must not
        write to them again). Raises ValueError for malformed arguments; disk errors are logged
        and counted in ``dropped_writes``, as are an entry bigger than ``max_bytes`` and any put
        after close().
        """
        header = _make_header(self._fingerprint, key, namespace, token_ids, base_pos, tags, k, v)
        size = len(header.encode()) + header.payload_len + _DIGEST_BYTES
        if self._closed or size > self.max_bytes:
            log.debug("chunk disk: not storing %s (%d bytes)", key.hex(), size)
            with self._lock:
                self.dropped_writes += 1
            return
        if self._queue is None:
            self._run_job(_Job(header, k, v, size))
            return
        # A lock-free look first, so a backlog does not cost the engine thread a copy per put.
        if not self._has_room(size):
            with self._lock:
                self.dropped_writes += 1
            return
        if copy:
            k, v = k.detach().clone(), v.detach().clone()
        job = _Job(header, k, v, size, reserved=size)
        with self._lock:
            if self._closed or not self._has_room(size):
                self.dropped_writes += 1
                return
            self._queued_bytes += size
            self._pending.add(job)
            self._queue.put(job)

    def get(
        self, key: bytes, namespace: str, token_ids: Sequence[int]
    ) -> tuple[int, torch.Tensor, torch.Tensor, tuple[str, ...]] | None:
        """(base_pos, k, v, tags) of the entry, or None. k and v are views of a buffer this call
        allocates and nobody else holds. A file that fails verification is deleted (and logged);
        one that verifies but belongs to another namespace or token sequence is only a miss.
        """
        path = self._file(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.namespace != namespace:
                self.misses += 1
        if entry is None:
            return None
        if entry.namespace != namespace:
            log.warning("chunk disk: key %s belongs to another namespace", key.hex())
            return None
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                buf = torch.empty(stat.st_size, dtype=torch.uint8)
                complete = _read_into(f, buf) == stat.st_size
        except FileNotFoundError:
            with self._lock:
                self.misses += 1
                # deleted behind our back; an eviction would already have dropped the entry
                if self._index.get(key) is entry:
                    self._forget_locked(key)
            return None
        except OSError as exc:
            log.warning("chunk disk: cannot read %s: %s", path, exc)
            with self._lock:
                self.misses += 1
            return None
        try:
            if not complete:
                raise _CorruptError("file shorter than its size")
            header, k, v = self._decode(key, buf)
        except _CorruptError as exc:
            log.warning("chunk disk: deleting corrupt %s: %s", path, exc)
            self._remove_corrupt(key, path, stat)
            return None
        if header.namespace != namespace or header.token_ids != tuple(token_ids):
            # A 16-byte hash collision is not the likely cause; a caller's key bug is.
            log.warning("chunk disk: key %s belongs to another token sequence", key.hex())
            with self._lock:
                self.misses += 1
            return None
        with self._lock:
            self.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # so recency survives a restart
        return header.base_pos, k, v, header.tags

    def contains(self, key: bytes) -> bool:
        """Whether a file for ``key`` is indexed (a write still queued does not count)."""
        with self._lock:
            return key in self._index

    def discard(self, key: bytes) -> None:
        """Delete the entry, and cancel any queued write of it."""
        with self._lock:
            for job in self._pending:
                if job.header.key == key:
                    job.cancelled = True
            self._remove_locked(key)

    def drop_tag(self, namespace: str, tag: str) -> int:
        """Delete every file of ``namespace`` tagged ``tag``, and cancel such queued writes;
        returns how many files were deleted."""
        with self._lock:
            for job in self._pending:
                if job.header.namespace == namespace and tag in job.header.tags:
                    job.cancelled = True
            victims = [
                key
                for key, entry in self._index.items()
                if entry.namespace == namespace and tag in entry.tags
            ]
            for key in victims:
                self._remove_locked(key)
        return len(victims)

    def flush(self) -> None:
        """Wait until every queued write is on disk (or dropped)."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Finish queued writes and stop the writer; later puts are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)  # after every queued job, so those are written first
            self._thread.join()

    # -- writing ------------------------------------------------------------------------------

    def _has_room(self, size: int) -> bool:
        # An empty queue takes any entry, so one bigger than the budget is still written.
        queued = self._queued_bytes
        return queued == 0 or queued + size <= self.max_queue_bytes

    def _writer_loop(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._run_job(job)
            except Exception:
                # keep the thread alive: flush() waits on it
                log.exception("chunk disk: writer failed")
            finally:
                self._queue.task_done()

    def _run_job(self, job: _Job) -> None:
        try:
            self._write(job)
        except OSError as exc:
            log.warning("chunk disk: write of %s failed: %s", job.header.key.hex(), exc)
            with self._lock:
                self.dropped_writes += 1
        finally:
            with self._lock:
                self._pending.discard(job)
                self._queued_bytes -= job.reserved

    def _write(self, job: _Job) -> None:
        header = job.header
        fd, tmp_name = tempfile.mkstemp(
            dir=self.path, prefix=f".{header.key.hex()}.", suffix=_TMP_SUFFIX
        )
        committed = False
        try:
            with open(fd, "wb") as f:
                hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES)
                prefix = header.encode()
                hasher.update(prefix)
                f.write(prefix)
                for tensor in (job.k, job.v):
                    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
                    for start in range(0, len(data), _PIECE_BYTES):
                        piece = data[start : start + _PIECE_BYTES]
                        hasher.update(piece)
                        f.write(piece)
                        if _piece_hook is not None:
                            _piece_hook()
                f.write(hasher.digest())
                f.flush()
                os.fsync(f.fileno())
            # Under the lock, so a discard()/drop_tag() either sees the file or cancels the job.
            with self._lock:
                if job.cancelled:
                    return
                os.replace(tmp_name, self._file(header.key))
                committed = True
                self._forget_locked(header.key)
                self._index[header.key] = _Entry(header.namespace, frozenset(header.tags), job.size)
                self._bytes += job.size
                self.writes += 1
                self._evict_locked()
        finally:
            if not committed:
                _unlink(Path(tmp_name))
        _fsync_dir(self.path)

    # -- index --------------------------------------------------------------------------------

    def _file(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}{_SUFFIX}"

    def _load_index(self) -> None:
        """Index the directory from file headers alone; drop temp files and unusable files."""
        found: list[tuple[int, bytes, _Entry]] = []
        for item in os.scandir(self.path):
            path = Path(item.path)
            if item.name.endswith(_TMP_SUFFIX):
                log.info("chunk disk: removing %s, left by an interrupted write", path)
                _unlink(path)
                continue
            if not item.name.endswith(_SUFFIX) or not item.is_file():
                continue
            try:
                key = bytes.fromhex(item.name.removesuffix(_SUFFIX))
            except ValueError:
                continue  # not a file of ours
            try:
                with open(path, "rb") as f:
                    stat = os.fstat(f.fileno())
                    header, offset = _read_header(f)
                self._check_header(header, key, stat.st_size, offset)
            except FileNotFoundError:
                continue
            except (OSError, _CorruptError) as exc:
                log.warning("chunk disk: deleting unusable %s: %s", path, exc)
                self.corrupt += 1
                _unlink(path)
                continue
            entry = _Entry(header.namespace, frozenset(header.tags), stat.st_size)
            found.append((stat.st_mtime_ns, key, entry))
        for _, key, entry in sorted(found, key=lambda item: item[0]):
            self._index[key] = entry
            self._bytes += entry.size

    def _check_header(self, header: _Header, key: bytes, size: int, offset: int) -> None:
        if header.key != key:
            raise _CorruptError("header key differs from the file name")
        if header.fingerprint != self._fingerprint:
            raise _CorruptError(f"fingerprint {header.fingerprint} is not this tier's")
        if size != offset + header.payload_len + _DIGEST_BYTES:
            raise _CorruptError(f"size {size} does not match the header")

    def _decode(self, key: bytes, buf: torch.Tensor) -> tuple[_Header, torch.Tensor, torch.Tensor]:
        view = buf.numpy().data
        if len(view) < _PREFIX.size + _DIGEST_BYTES:
            raise _CorruptError("too short")
        header_len = _unpack_prefix(bytes(view[: _PREFIX.size]))
        digest = hashlib.blake2b(view[:-_DIGEST_BYTES], digest_size=_DIGEST_BYTES).digest()
        if digest != bytes(view[-_DIGEST_BYTES:]):
            raise _CorruptError("checksum mismatch")
        offset = _PREFIX.size + header_len
        header = _Header.decode(bytes(view[_PREFIX.size : offset]))
        self._check_header(header, key, len(view), offset)
        n = header.tensor_bytes
        k = buf[offset : offset + n].view(header.dtype).view(header.shape)
        v = buf[offset + n : offset + 2 * n].view(header.dtype).view(header.shape)
        return header, k, v

    def _remove_corrupt(self, key: bytes, path: Path, stat: os.stat_result) -> None:
        with self._lock:
            self.corrupt += 1
            self.misses += 1
            try:
                current = os.stat(path)
            except FileNotFoundError:
                return
            # Only the file we read: a good one may have been renamed over it since.
            if (current.st_dev, current.st_ino) == (stat.st_dev, stat.st_ino):
                _unlink(path)
                self._forget_locked(key)

    def _forget_locked(self, key: bytes) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size

    def _remove_locked(self, key: bytes) -> None:
        if key in self._index:
            self._forget_locked(key)
            _unlink(self._file(key))

    def _evict_locked(self) -> None:
        while self._bytes > self.max_bytes and self._index:
            self._remove_locked(next(iter(self._index)))


def fingerprint_id(fingerprint: Mapping[str, str | int]) -> str:
    """The directory name for a fingerprint: 16 hex digits of BLAKE2b over its sorted JSON."""
    blob = json.dumps(_normalize_fingerprint(fingerprint), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def _normalize_fingerprint(fingerprint: Mapping[str, str | int]) -> dict[str, str | int]:
    out: dict[str, str | int] = {}
    for name, value in fingerprint.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(f"fingerprint entries must be str -> str | int, got {name!r}")
        out[name] = value
    return out


def _make_header(
    fingerprint: dict[str, str | int],
    key: bytes,
    namespace: str,
    token_ids: Sequence[int],
    base_pos: int,
    tags: Iterable[str],
    k: torch.Tensor,
    v: torch.Tensor,
) -> _Header:
    if not isinstance(key, bytes) or not 0 < len(key) <= _MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{_MAX_KEY_BYTES} bytes")
    tokens = tuple(int(t) for t in token_ids)
    tag_tuple = tuple(tags)
    if not isinstance(namespace, str) or not all(isinstance(t, str) for t in tag_tuple):
        raise ValueError("namespace and tags must be str")
    if isinstance(base_pos, bool) or not isinstance(base_pos, int) or base_pos < 0:
        raise ValueError(f"base_pos must be an int >= 0, got {base_pos!r}")
    if k.shape != v.shape or k.dtype != v.dtype or k.dim() != 4:
        raise ValueError(f"k and v must share a 4-d shape and dtype: {k.shape} vs {v.shape}")
    if k.device.type != "cpu" or v.device.type != "cpu":
        raise ValueError("k and v must be CPU tensors")
    if k.shape[1] != len(tokens):
        raise ValueError(f"{len(tokens)} token ids for {k.shape[1]} KV positions")
    dtype_name = str(k.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise ValueError(f"unsupported dtype {k.dtype}")
    return _Header(
        key=key,
        fingerprint=fingerprint,
        namespace=namespace,
        token_ids=tokens,
        base_pos=base_pos,
        tags=tag_tuple,
        dtype=k.dtype,
        shape=tuple(k.shape),  # type: ignore[arg-type]  # dim() == 4 checked above
    )


def _unpack_prefix(prefix: bytes) -> int:
    """Header length from the 12-byte prefix; raises _CorruptError."""
    if len(prefix) < _PREFIX.size:
        raise _CorruptError("too short")
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise _CorruptError("bad magic")
    if version != FORMAT_VERSION:
        raise _CorruptError(f"format version {version}, expected {FORMAT_VERSION}")
    if header_len > _MAX_HEADER_BYTES:
        raise _CorruptError(f"header length {header_len}")
    return header_len


def _read_header(f: BinaryIO) -> tuple[_Header, int]:
    """The header of an open file and the payload's offset, reading nothing past the header."""
    header_len = _unpack_prefix(f.read(_PREFIX.size))
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise _CorruptError("truncated header")
    return _Header.decode(raw), _PREFIX.size + header_len


def _read_into(f: BinaryIO, buf: torch.Tensor) -> int:
    view = buf.numpy().data
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done


def _unlink(path: Path) -> None:
    # Best effort: a file that cannot be deleted is unindexed now and re-verified at a restart.
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("chunk disk: cannot delete %s: %s", path, exc)


def _fsync_dir(path: Path) -> None:
    # Makes the rename durable; not every platform lets a directory be opened, hence best effort.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
