"""The disk cache of downloaded adapters: `<cache_root>/lora-cache/<sha256(uri)>/`, LRU by bytes.

- A folder's name is the sha256 of the adapter URI, so no adapter name can reach outside the root.
- A download goes into `.tmp-<host>-*` inside the root, is verified (both files, the safetensors header covers
  exactly the file, the config is a JSON object), gets a meta.json, then one `os.rename` makes it visible. A crash
  leaves only `.tmp-*` folders. At start we remove our host's (a previous run of this container) and other hosts'
  older than an hour: workers may share a network volume, and another worker's download in flight must survive.
- Single flight: the first `get` of a URI downloads; concurrent `get`s of the same URI wait for it. Different
  URIs download in parallel (the lock is never held during I/O).
- Recency is meta.json's mtime (touched on each hit), so the LRU order survives a restart.
- Local folders (LORA_MODULES paths) are verified and read in place: copying a folder the operator owns buys
  nothing, and keeps the byte budget for S3 downloads."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from engine.errors import EngineError, InvalidRequestError
from engine.lora.source import CONFIG_FILE, PICKLE_FILE, WEIGHTS_FILE, AdapterRef, LoRALoadError, fetch

log = logging.getLogger(__name__)
META_FILE = "meta.json"
STALE_TMP_S = 3600.0
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
FetchFn = Callable[[AdapterRef, Path], None]


def cache_key(ref: AdapterRef) -> str:
    return hashlib.sha256(ref.uri.encode()).hexdigest()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def verify_adapter_dir(path: Path, name: str = "?") -> int:
    """Cheap structural checks before a folder becomes visible; returns its size in bytes.
    A truncated or garbled download is the adapter's problem as far as the request goes: InvalidRequestError."""

    def bad(why: str):
        return InvalidRequestError(f"adapter {name!r}: {why}", field="lora")

    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise bad(f"{CONFIG_FILE} is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise bad(f"{CONFIG_FILE} is not a JSON object")
    st = path / WEIGHTS_FILE
    if not st.is_file():
        pickled = (path / PICKLE_FILE).is_file()
        raise bad(f"{WEIGHTS_FILE} is missing" + (f"; {PICKLE_FILE} (pickle) is refused" if pickled else ""))
    size = st.stat().st_size
    with open(st, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, 100 << 20):
            raise bad(f"{WEIGHTS_FILE} is truncated or not safetensors ({size} bytes)")
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise bad(f"{WEIGHTS_FILE} has a corrupt header") from None
    if max(ends, default=0) != size - 8 - n:  # the tensors must cover the data exactly: catches truncation
        raise bad(
            f"{WEIGHTS_FILE} is truncated or corrupt: the header describes {max(ends, default=0)} data bytes, "
            f"the file has {size - 8 - n}"
        )
    return _dir_bytes(path)


class _Entry:
    __slots__ = ("path", "nbytes", "pins")

    def __init__(self, path: Path, nbytes: int):
        self.path, self.nbytes, self.pins = path, nbytes, 0


class _Flight:
    """One download in progress; waiters block on `done`."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None


def disk_full(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from, is the disk (or its quota) being full."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _copy_error(e: BaseException) -> EngineError:
    # Each waiter raises its own exception object (one instance raised in many threads shares a traceback).
    if isinstance(e, InvalidRequestError):
        return InvalidRequestError(str(e), field=e.field)
    return LoRALoadError(str(e))


class AdapterDiskCache:
    def __init__(self, root: str | Path, max_bytes: int, fetch_fn: FetchFn | None = None):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.fetch_fn = fetch_fn or functools.partial(fetch, endpoint_url=None)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._flights: dict[str, _Flight] = {}
        self._stats = dict(hits=0, misses=0, coalesced=0, downloads=0, failures=0, evictions=0, uncached=0)
        self.root.mkdir(parents=True, exist_ok=True)
        found, now = [], time.time()
        for d in self.root.iterdir():
            if not d.is_dir():
                continue
            if not d.name.startswith("."):
                if (d / META_FILE).is_file():
                    found.append(((d / META_FILE).stat().st_mtime, d))
                else:  # renames carry meta.json, so this was never a complete entry
                    shutil.rmtree(d, ignore_errors=True)
            elif d.name.startswith(f".tmp-{_HOST}-") or now - d.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(d, ignore_errors=True)
        for _, d in sorted(found):
            self._entries[d.name] = _Entry(d, _dir_bytes(d))
        with self._lock:
            doomed = self._evict_locked(keep=None)
        self._remove(doomed)

    @classmethod
    def from_config(cls, config, max_adapter_bytes: int | None = None) -> AdapterDiskCache:
        fn = functools.partial(fetch, endpoint_url=config.s3_endpoint_url, max_bytes=max_adapter_bytes)
        return cls(Path(config.cache_root) / "lora-cache", config.lora_cache_bytes, fn)

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats, bytes=sum(e.nbytes for e in self._entries.values()), entries=len(self._entries))

    def __contains__(self, ref: AdapterRef) -> bool:
        with self._lock:
            return cache_key(ref) in self._entries

    def get(self, ref: AdapterRef, fetch_fn: FetchFn | None = None, timeout: float | None = None) -> Path:
        """The adapter's folder, downloading it once if needed. The folder may be evicted by a later insert;
        use `use()` to pin it while reading."""
        return self._get(ref, fetch_fn, timeout, pin=False)

    @contextlib.contextmanager
    def use(self, ref: AdapterRef, fetch_fn: FetchFn | None = None, timeout: float | None = None):
        """`with cache.use(ref) as path:` the folder cannot be evicted inside the block."""
        path = self._get(ref, fetch_fn, timeout, pin=True)
        try:
            yield path
        finally:
            if ref.is_s3 and path.parent != self.root:  # not cached (a full volume): used once
                shutil.rmtree(path, ignore_errors=True)
            elif ref.is_s3:
                with self._lock:
                    e = self._entries.get(cache_key(ref))
                    if e is not None:
                        e.pins -= 1
                    doomed = self._evict_locked(keep=None)
                self._remove(doomed)

    def _get(self, ref: AdapterRef, fetch_fn: FetchFn | None, timeout: float | None, pin: bool) -> Path:
        if not ref.is_s3:
            verify_adapter_dir(Path(ref.uri), ref.name)
            return Path(ref.uri)
        key = cache_key(ref)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                e = self._entries.get(key)
                if e is not None:
                    self._entries.move_to_end(key)
                    self._stats["hits"] += 1
                    e.pins += 1  # while it is checked
            if e is not None:
                try:  # damaged on the volume since it was cached (cut short, overwritten): fetched again
                    verify_adapter_dir(e.path, ref.name)
                except InvalidRequestError as bad:
                    log.warning("lora: the cached copy of %s is damaged (%s): downloading it again", ref.name, bad)
                    self.drop(ref, unpin=True)
                    continue
                with self._lock:
                    e.pins -= not pin
                with contextlib.suppress(OSError):
                    os.utime(e.path / META_FILE)  # persist recency for the next process
                return e.path
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = _Flight()
                    self._stats["misses"] += 1
                    break
                self._stats["coalesced"] += 1
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not flight.done.wait(left):
                raise LoRALoadError(f"adapter {ref.name!r} was not downloaded within {timeout:g} s")
            if flight.error is not None:
                raise _copy_error(flight.error)
            # else: loop; the entry is there now (unless already evicted, then this thread downloads it again)
        try:
            path, nbytes = self._download(ref, key, fetch_fn or self.fetch_fn)
        except BaseException as e:
            full = disk_full(e)
            flight.error = None if full else e  # a full disk: each waiter tries on its own, as this one does
            with self._lock:
                self._stats["failures"] += not full
                del self._flights[key]
            flight.done.set()
            if not full:
                raise
            return self._uncached(ref, fetch_fn or self.fetch_fn, e)
        with self._lock:
            self._entries[key] = entry = _Entry(path, nbytes)
            entry.pins += pin
            doomed = self._evict_locked(keep=key)
            del self._flights[key]
        flight.done.set()
        self._remove(doomed)
        return path

    def _uncached(self, ref: AdapterRef, fetch_fn: FetchFn, why: BaseException) -> Path:
        """The volume is full: the adapter goes to a private temporary folder on the container's own disk instead,
        verified the same way, used once and deleted after (use()); nothing half-written stays in the cache."""
        log.warning("lora: the cache %s is full (%s): %s is downloaded without caching", self.root, why, ref.name)
        tmp = Path(tempfile.mkdtemp(prefix="lora-uncached-"))
        try:
            fetch_fn(ref, tmp)
            verify_adapter_dir(tmp, ref.name)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, EngineError):
                raise
            raise LoRALoadError(f"adapter {ref.name!r}: download failed: {type(e).__name__}: {e}") from e
        with self._lock:
            self._stats["uncached"] += 1
        return tmp

    def drop(self, ref: AdapterRef, unpin: bool = False) -> None:
        """Forget a cached adapter and delete its folder (its files proved damaged): the next get downloads it again.
        unpin: the caller holds one pin on it."""
        key = cache_key(ref)
        with self._lock:
            e = self._entries.pop(key, None)
            if e is None:
                return
            e.pins -= unpin
            gone = self.root / f".tmp-{_HOST}-drop-{key[:16]}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(e.path, gone)
            except OSError:
                gone = e.path
        self._remove([gone])

    def _download(self, ref: AdapterRef, key: str, fetch_fn: FetchFn) -> tuple[Path, int]:
        final = self.root / key
        if (final / META_FILE).is_file():  # placed by another process sharing the volume, or a lost entry
            return final, _dir_bytes(final)
        tmp = self.root / f".tmp-{_HOST}-dl-{key[:16]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            with self._lock:
                self._stats["downloads"] += 1
            t0 = time.monotonic()
            try:
                fetch_fn(ref, tmp)
            except EngineError:
                raise
            except Exception as e:  # disk full, a bug in a custom fetch_fn: still this request's error only
                raise LoRALoadError(f"adapter {ref.name!r}: download failed: {type(e).__name__}: {e}") from e
            nbytes = verify_adapter_dir(tmp, ref.name)
            meta = dict(name=ref.name, uri=ref.uri, bytes=nbytes, created=time.time())
            (tmp / META_FILE).write_text(json.dumps(meta))
            try:
                os.rename(tmp, final)
            except OSError:  # another process renamed the same adapter first: theirs is as good as ours
                if not (final / META_FILE).is_file():
                    raise
            log.info("lora: downloaded %s (%s) %d bytes in %.2f s", ref.name, ref.uri, nbytes, time.monotonic() - t0)
            return final, _dir_bytes(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _evict_locked(self, keep: str | None) -> list[Path]:
        """Drop least-recently-used unpinned entries until under budget; never `keep` (just inserted) nor the most
        recently used one (an adapter bigger than the budget stays until the next insert). Folders are renamed
        out of sight here and deleted outside the lock."""
        mru = next(reversed(self._entries), None)
        total = sum(e.nbytes for e in self._entries.values())
        doomed = []
        for key in list(self._entries):
            if total <= self.max_bytes:
                break
            e = self._entries[key]
            if key == keep or key == mru or e.pins > 0:
                continue
            del self._entries[key]
            total -= e.nbytes
            self._stats["evictions"] += 1
            gone = self.root / f".tmp-{_HOST}-evict-{key[:16]}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(e.path, gone)
                doomed.append(gone)
            except OSError:
                doomed.append(e.path)
        return doomed

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
