"""Node page store: the CPU copy of every plane and LUT, written once into shared memory, mapped by every engine.

Why: reloads need a pinned host source, and pinning a private copy per GPU process would cost one copy of the
model per GPU. Here one page-aligned file on tmpfs (/dev/shm) holds every plane/LUT at a 4096-byte-aligned
offset, indexed by msgpack; each engine maps it read-only (MAP_SHARED, so all processes share the same physical
pages), and pins the mapping in place with cudaHostRegister(ReadOnly) — never `tensor.pin_memory()`, which copies.
The store is plain files, not `multiprocessing.shared_memory`, so no resource tracker can unlink it when a reader
exits: only `PageStore.destroy` removes it.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import torch

from pagedweight.progress import byte_progress

ALIGN = 4096
FORMAT_VERSION = 1
CUDA_HOST_REGISTER_READ_ONLY = 8
WHAT = ("plane", "lut")
# a store this small is written in well under a second: no progress for it (the tests' stores, the tiny model's)
PROGRESS_MIN_BYTES = 256 << 20
# the copy loop updates its bar once per this many bytes, not per record (tens of thousands of small planes and LUTs)
PROGRESS_STEP_BYTES = 64 << 20


@dataclass(frozen=True)
class Record:
    """Where one plane (idx = plane p) or LUT (idx = width b) of block `block` lies in a source file."""

    block: int
    what: str  # "plane" | "lut"
    idx: int
    offset: int
    nbytes: int


class PageStoreFull(OSError):
    """The store's filesystem (tmpfs) has no room for it: said before a byte is written, or when a write runs out."""

    def __init__(self, path: Path, need: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"the page store needs {need / 2**30:.2f} GiB at {path}, {free / 2**30:.2f} GiB "
                         "free there: enlarge that tmpfs (Docker: --shm-size or --ipc=host; Kubernetes: a "
                         "memory-backed emptyDir on /dev/shm, as clusters/ does) or choose another place "
                         "(page_store_dir; the Serve app's store_root)")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@contextmanager
def _lock(path: Path, exclusive: bool, make: bool = False) -> Iterator[None]:
    """Hold `path/.lock` (flock): exclusive to write or remove a store, shared to open one. A shared lock needs only
    read access; where the lock file cannot be read (no store yet, or not readable) it goes unlocked. Retried until
    the lock held is the directory's current one: `destroy` unlinks it, and a waiter woken on the old file would
    otherwise write beside a creator that made a new one."""
    lock = path / ".lock"
    while True:
        if make:
            path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, (os.O_WRONLY | os.O_CREAT) if exclusive else os.O_RDONLY, 0o666)
        except FileNotFoundError:
            if make:
                continue  # `destroy` removed the directory between mkdir and open
            if exclusive:
                raise
            fd = None
        except PermissionError:
            if exclusive:
                raise
            fd = None
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            held = os.fstat(fd)
            try:
                now = os.stat(lock)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                yield
                return
        finally:
            os.close(fd)


class PageStore:
    """Read-only mapping of a store directory (`pages.bin` + `index.msgpack`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = msgpack.unpackb((self.path / "index.msgpack").read_bytes())
        if index["version"] != FORMAT_VERSION:
            raise ValueError(f"page store format {index['version']} != {FORMAT_VERSION}")
        self.nbytes = index["nbytes"]
        self.identity: str | None = index.get("identity")  # what the creator said the source is (None: not said)
        self._entries = {(b, w, i): (off, n) for b, w, i, off, n in index["entries"]}
        self._mapping = _Mapping.acquire(self.path / "pages.bin", self.nbytes)
        self.array, self._tensor = self._mapping.array, self._mapping.tensor
        self._closed = False
        self.written = False  # this process wrote the store (`create`): only such a process may remove it

    @property
    def pinned(self) -> bool:
        return self._mapping.pinned

    # ---- creation (once per node) ----
    @classmethod
    def create(cls, path: str | os.PathLike, source: str | os.PathLike, records: list[Record],
               identity: str | None = None) -> PageStore:
        """Copy `records` from `source` into a new store at `path`, or open it if a complete store of them is there
        (a store of anything else is refused). `identity` names the source's content (a checkpoint's planes
        checksum): recorded when writing, and an existing store must have recorded the same.

        Creation is serialized by a file lock, so several engines of a node racing here write it once; the index
        is renamed into place last, so a store with an index is complete, and opening one needs no write access.
        """
        path, source = Path(path), Path(source)
        with _lock(path, exclusive=False):  # held while mapping: `destroy` waits for it
            if (path / "index.msgpack").exists():
                return cls._open_checked(path, source, records, identity)
        with _lock(path, exclusive=True, make=True):
            if (path / "index.msgpack").exists():  # another engine wrote it meanwhile
                return cls._open_checked(path, source, records, identity)
            cls._write(path, source, records, identity)
            store = cls(path)
            store.written = True
            return store

    @classmethod
    def _open_checked(cls, path: Path, source: Path, records: list[Record], identity: str | None) -> PageStore:
        store = cls(path)
        try:
            store._check_holds(source, records, identity)
        except BaseException:
            store.close()
            raise
        return store

    def _check_holds(self, source: Path, records: list[Record], identity: str | None, samples: int = 8,
                     nbytes: int = 4096) -> None:
        """An existing store serves these records only if it recorded the same `identity` (when one is given: a
        store that recorded none, written before stores did, cannot show what it holds), has their layout and their
        bytes (the first `nbytes` of `samples` records spread over them, read from `source`): a directory reused for
        another checkpoint of the same shapes would otherwise serve the old planes to every reload. The samples
        alone miss planes that differ elsewhere."""
        # a store written before stores recorded their planes, under the default name that already says which
        # (`pagedweight-<planes id>`): trusted, so that a node's store does not stop every engine after an upgrade
        legacy = self.identity is None and identity is not None and self.path.name.endswith(f"-{identity}")
        if identity is not None and self.identity != identity and not legacy:
            held = "unrecorded planes (a store written before stores recorded theirs)" if self.identity is None \
                else f"planes {self.identity}"
            raise ValueError(f"the page store at {self.path} holds {held}, not {source}'s planes {identity}: remove "
                             "it (rm -r, or PageStore.destroy; engines that map it keep their pages) or give another "
                             "directory")
        if {(r.block, r.what, r.idx): r.nbytes for r in records} != {k: n for k, (_, n) in self._entries.items()}:
            raise ValueError(f"the page store at {self.path} holds other blocks than {source} asks for: remove it "
                             "or give another directory")
        with open(source, "rb") as src:
            for r in records[::max(1, len(records) // samples)]:
                src.seek(r.offset)
                off, n = self._entries[(r.block, r.what, r.idx)]
                if src.read(min(n, nbytes)) != self.array[off:off + min(n, nbytes)].tobytes():
                    raise ValueError(f"the page store at {self.path} holds other planes than {source}: remove it "
                                     "or give another directory")

    @staticmethod
    def _write(path: Path, source: Path, records: list[Record], identity: str | None) -> None:
        entries, pos = [], 0
        for r in records:
            if r.what not in WHAT:
                raise ValueError(f"record kind {r.what!r} not in {WHAT}")
            entries.append([r.block, r.what, r.idx, pos, r.nbytes])
            pos = _align(pos + r.nbytes)
        if len({tuple(e[:3]) for e in entries}) != len(entries):
            raise ValueError("duplicate (block, what, idx) records")
        index = msgpack.packb({"version": FORMAT_VERSION, "align": ALIGN, "nbytes": pos, "source": str(source),
                               "identity": identity, "entries": entries})
        # no index: what a writer killed here, or a failed index write, left is incomplete and would count against
        # the free space below (every later create refused as full); readers that map an old file keep its pages
        leftovers = [path / name for name in ("pages.bin.tmp", "pages.bin", "index.msgpack.tmp")]
        for f in leftovers:
            f.unlink(missing_ok=True)
        need = _align(pos) + _align(len(index))  # the data and the index, in whole pages as tmpfs allocates them
        free = shutil.disk_usage(path).free  # a tmpfs too small is refused before writing (Docker's is 64 MiB)
        if need > free:
            raise PageStoreFull(path, need, free)
        tmp = path / "pages.bin.tmp"
        try:
            with open(source, "rb") as src, open(tmp, "wb") as dst, \
                    byte_progress(sum(r.nbytes for r in records), "page store", PROGRESS_MIN_BYTES, source) as bar:
                src_size = os.fstat(src.fileno()).st_size
                copied = 0  # since the bar's last update
                for r, e in zip(records, entries):  # plain writes: a full tmpfs raises ENOSPC instead of SIGBUS
                    if r.offset < 0 or r.offset + r.nbytes > src_size:
                        raise ValueError(f"record {r} outside the source file ({src_size} B)")
                    src.seek(r.offset)
                    dst.seek(e[3])
                    dst.write(src.read(r.nbytes))
                    copied += r.nbytes
                    if copied >= PROGRESS_STEP_BYTES:
                        bar.update(copied)
                        copied = 0
                bar.update(copied)
                dst.truncate(pos)
            os.replace(tmp, path / "pages.bin")
            (path / "index.msgpack.tmp").write_bytes(index)
            os.replace(path / "index.msgpack.tmp", path / "index.msgpack")  # last: an index means a whole store
        except BaseException as exc:  # a partial store would hold the node's shared memory for nothing
            for f in leftovers:
                f.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise PageStoreFull(path, need, shutil.disk_usage(path).free) from exc
            raise

    @staticmethod
    def destroy(path: str | os.PathLike) -> None:
        """Remove the store (mappings that are still open keep their pages until they close).

        Under the creators' lock: unlocked, it removed a store mid-write (the writer failed) and the lock file under
        the writer, so that a second creator wrote beside it."""
        path = Path(path)
        with _lock(path, exclusive=True):
            for name in ("index.msgpack", "pages.bin", "pages.bin.tmp", "index.msgpack.tmp", ".lock"):
                (path / name).unlink(missing_ok=True)
            try:
                path.rmdir()
            except OSError as exc:  # a creator came after the lock file went: the directory is its now
                if exc.errno != errno.ENOTEMPTY or not (path / ".lock").exists():
                    raise

    # ---- views ----
    def keys(self) -> list[tuple[int, str, int]]:
        return list(self._entries)

    def extent(self, block: int, what: str, idx: int) -> tuple[int, int]:
        """(offset, nbytes) inside pages.bin."""
        return self._entries[(block, what, idx)]

    def view(self, block: int, what: str, idx: int) -> np.ndarray:
        """Zero-copy read-only numpy uint8 view."""
        off, n = self._entries[(block, what, idx)]
        return self.array[off:off + n]

    def tensor(self, block: int, what: str, idx: int) -> torch.Tensor:
        """Zero-copy CPU uint8 tensor (the source of reload copies; pinned once `pin` ran)."""
        off, n = self._entries[(block, what, idx)]
        return self._tensor[off:off + n]

    def arrow(self, block: int, what: str, idx: int) -> pa.Buffer:
        """Zero-copy Arrow buffer."""
        off, n = self._entries[(block, what, idx)]
        return pa.py_buffer(self._mapping.mm)[off:off + n]

    # ---- pinning ----
    def pin(self) -> bool:
        """Page-lock the mapping in place (ReadOnly flag: the mapping is PROT_READ); False without CUDA."""
        return self._mapping.pin()

    def close(self) -> None:
        """Drop this reader's hold; the process mapping is unpinned and unmapped with its last reader.

        The store itself stays."""
        if not self._closed:
            self._closed = True
            del self._tensor, self.array
            self._mapping.release()


class _Mapping:
    """One read-only mapping of a store file per process, shared by every PageStore opened on it.

    Why: pinning is tied to virtual addresses. Two mappings of one file would pin twice, and a mapping unmapped
    while still registered leaves the driver a stale registration that a later mapping at the same address
    collides with (cudaErrorHostMemoryAlreadyRegistered) — or worse, copies from. So a process maps each store
    once, pins it once, and unregisters before it unmaps.
    """

    _open: dict[tuple[int, ...], "_Mapping"] = {}

    def __init__(self, key: tuple[int, ...], file: Path, nbytes: int) -> None:
        self.key, self.nbytes, self.readers, self.pinned = key, nbytes, 0, False
        fd = os.open(file, os.O_RDONLY)
        try:
            self.mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8, count=nbytes)  # read-only view
        with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is, by design
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.from_numpy(self.array)

    @classmethod
    def acquire(cls, file: Path, nbytes: int) -> "_Mapping":
        st = os.stat(file)
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)  # a re-created store never matches an old one
        mapping = cls._open.get(key)
        if mapping is None:
            mapping = cls._open[key] = cls(key, file, nbytes)
        mapping.readers += 1
        return mapping

    def pin(self) -> bool:
        if self.pinned or not torch.cuda.is_available() or self.nbytes == 0:
            return self.pinned
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.array.ctypes.data, self.nbytes, CUDA_HOST_REGISTER_READ_ONLY)
        if int(err) != 0:
            cudart.cudaGetLastError()  # clear it, so the next torch CUDA call does not inherit it
            raise RuntimeError(f"cudaHostRegister(ReadOnly) of {self.nbytes} B failed: error {int(err)}")
        self.pinned = True
        return True

    def release(self) -> None:
        self.readers -= 1
        if self.readers > 0:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.pinned = False
        del _Mapping._open[self.key]
        del self.tensor, self.array
        try:
            self.mm.close()
        except BufferError:  # views still alive keep the mapping until they go (unpinned by now)
            pass


def write_planes_file(path: str | os.PathLike, block_sizes: list[tuple[int, dict[int, int]]], parent_bits: int,
                      seed: int = 0) -> list[Record]:
    """Write random planes/LUTs laid out like an AP checkpoint's planes file (4096-aligned); return their records.

    `block_sizes[i] = (plane_bytes, {width: lut_bytes})`. Synthetic input for tests and benchmarks, until a real
    checkpoint's `load_ap` supplies the records.
    """
    rng = np.random.default_rng(seed)
    records, pos = [], 0
    with open(path, "wb") as f:
        for i, (plane_bytes, luts) in enumerate(block_sizes):
            for what, idx, n in [("plane", p, plane_bytes) for p in range(parent_bits)] + \
                                [("lut", b, nb) for b, nb in sorted(luts.items())]:
                f.seek(pos)
                f.write(rng.bytes(n))
                records.append(Record(i, what, idx, pos, n))
                pos = _align(pos + n)
        f.truncate(pos)
    return records
