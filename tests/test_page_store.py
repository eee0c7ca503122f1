"""Page store: written once, zero-copy views, shared physical pages across processes, readers never destroy it."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from helpers import Terminal
from pagedweight.page_store import ALIGN, PageStore, Record, write_planes_file

READER = r"""
import hashlib, sys
from pagedweight.page_store import PageStore
s = PageStore(sys.argv[1])
print(hashlib.blake2b(s.array.tobytes()).hexdigest(), flush=True)   # touches every page of the mapping
sys.stdin.readline()
print(hashlib.blake2b(s.array.tobytes()).hexdigest(), flush=True)
sys.stdin.readline()
"""


def _smaps(pid: int, path: Path) -> dict:
    """Rss/Pss/Shared_*/Anonymous (kB) and inode of `path`'s mapping in process `pid`."""
    out, inside = {}, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # mapping header: addr perms off dev inode path
            inside = len(head) >= 6 and head[5] == str(path)
            if inside:
                out["inode"] = int(head[4])
                out["perms"] = head[1]
        elif inside and head[0].rstrip(":") in ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Anonymous"):
            out[head[0].rstrip(":")] = out.get(head[0].rstrip(":"), 0) + int(head[1])
    return out


@pytest.fixture
def store_dir(tmp_path):
    src = tmp_path / "planes.bin"
    sizes = [(3000 + 512 * i, {2: 64 * (i + 1), 3: 128 * (i + 1)}) for i in range(6)]
    records = write_planes_file(src, sizes, parent_bits=3, seed=1)
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    path = shm / f"pw-test-{uuid.uuid4().hex[:8]}"
    yield path, src, records
    if path.exists():
        PageStore.destroy(path)


def test_views_match_source_and_are_aligned(store_dir):
    path, src, records = store_dir
    store = PageStore.create(path, src, records)
    raw = np.fromfile(src, dtype=np.uint8)
    for r in records:
        off, n = store.extent(r.block, r.what, r.idx)
        assert off % ALIGN == 0 and n == r.nbytes
        want = raw[r.offset:r.offset + r.nbytes]
        np.testing.assert_array_equal(store.view(r.block, r.what, r.idx), want)
        assert store.tensor(r.block, r.what, r.idx).numpy().tobytes() == want.tobytes()
        assert store.arrow(r.block, r.what, r.idx).to_pybytes() == want.tobytes()
    v = store.view(0, "plane", 0)
    assert not v.flags.writeable
    # zero-copy: the views point into the one mapping
    assert v.ctypes.data == store.array.ctypes.data + store.extent(0, "plane", 0)[0]
    assert store.tensor(0, "plane", 1).data_ptr() == store.array.ctypes.data + store.extent(0, "plane", 1)[0]
    assert store.pin() is False  # CPU-only box: nothing to pin
    store.close()


def test_written_once(store_dir):
    path, src, records = store_dir
    PageStore.create(path, src, records).close()
    ino = os.stat(path / "pages.bin").st_ino
    # a second create (another engine of the node) opens the existing store
    other = PageStore.create(path, src, records)
    assert os.stat(path / "pages.bin").st_ino == ino and len(other.keys()) == len(records)
    other.close()
    # a directory reused for other blocks, or for another checkpoint of the same shapes, is refused (its planes would
    # be served to every reload)
    with pytest.raises(ValueError, match="other blocks"):
        PageStore.create(path, src, records[:3])
    other_src = src.parent / "other-planes.bin"
    sizes = [(3000 + 512 * i, {2: 64 * (i + 1), 3: 128 * (i + 1)}) for i in range(6)]
    assert write_planes_file(other_src, sizes, parent_bits=3, seed=2) == records
    with pytest.raises(ValueError, match="other planes"):
        PageStore.create(path, other_src, records)
    assert os.stat(path / "pages.bin").st_ino == ino


def test_rejects_bad_records(tmp_path):
    src = tmp_path / "s.bin"
    src.write_bytes(b"x" * 100)
    with pytest.raises(ValueError):
        PageStore.create(tmp_path / "a", src, [Record(0, "plane", 0, 50, 60)])
    with pytest.raises(ValueError):
        PageStore.create(tmp_path / "b", src, [Record(0, "plane", 0, 0, 8), Record(0, "plane", 0, 8, 8)])


def test_a_tmpfs_too_small_is_refused_and_leaves_nothing(store_dir, monkeypatch):
    """Docker gives containers a 64 MiB /dev/shm: a store larger than the free room is refused before a byte is
    written, naming both sizes and the fixes; a write that runs out of room later (another process filled the tmpfs)
    leaves no partial file holding shared memory, and a later create with room succeeds."""
    import builtins
    import errno
    import shutil

    from pagedweight import page_store
    from pagedweight.page_store import PageStoreFull

    path, src, records = store_dir
    room = shutil.disk_usage(Path(src).parent)
    monkeypatch.setattr(page_store.shutil, "disk_usage", lambda p: room._replace(free=4096))
    with pytest.raises(PageStoreFull) as info:
        PageStore.create(path, src, records)
    assert info.value.errno == errno.ENOSPC and "GiB free there" in str(info.value) and "--shm-size" in str(info.value)
    assert sorted(p.name for p in path.iterdir()) == [".lock"]
    monkeypatch.undo()

    class Filling:  # a destination whose filesystem fills after the first write
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def filling_open(file, mode="r", *args, **kw):
        f = builtins.open(file, mode, *args, **kw)
        return Filling(f) if "w" in mode else f

    monkeypatch.setattr(page_store, "open", filling_open, raising=False)
    with pytest.raises(PageStoreFull):
        PageStore.create(path, src, records)
    assert sorted(p.name for p in path.iterdir()) == [".lock"]
    monkeypatch.undo()
    store = PageStore.create(path, src, records)
    assert len(store.keys()) == len(records)
    store.close()


def test_a_failed_index_write_or_a_killed_writer_leaves_no_store_behind(store_dir, monkeypatch):
    """The index is written last: when the tmpfs fills there (the planes fitted, the index did not), the planes file
    goes too and the error is PageStoreFull; what a writer killed mid-write left (no index) is removed before the
    space check, where it counted as used and refused every later create on a nearly full tmpfs."""
    import errno
    import shutil

    from pagedweight import page_store
    from pagedweight.page_store import PageStoreFull

    path, src, records = store_dir
    replace = os.replace

    def index_fails(a, b):
        if Path(b).name == "index.msgpack":
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(a, b)

    monkeypatch.setattr(page_store.os, "replace", index_fails)
    with pytest.raises(PageStoreFull):
        PageStore.create(path, src, records)
    assert sorted(p.name for p in path.iterdir()) == [".lock"]
    monkeypatch.undo()
    for name in ("pages.bin.tmp", "pages.bin", "index.msgpack.tmp"):  # a killed writer's, never completed
        (path / name).write_bytes(b"\0" * 8192)
    usage = shutil.disk_usage

    def after_cleanup(p):
        assert not any((path / n).exists() for n in ("pages.bin.tmp", "pages.bin", "index.msgpack.tmp"))
        return usage(p)

    monkeypatch.setattr(page_store.shutil, "disk_usage", after_cleanup)
    store = PageStore.create(path, src, records)
    assert store.written and len(store.keys()) == len(records)
    store.close()
    again = PageStore.create(path, src, records)  # an existing store: opened, not written (the CLI keeps it)
    assert not again.written
    again.close()


def test_two_processes_share_pages_and_reader_exit_keeps_store(store_dir):
    path, src, records = store_dir
    PageStore.create(path, src, records).close()  # creator unmaps: only the readers map it below
    data = path / "pages.bin"
    want = hashlib.blake2b(data.read_bytes()).hexdigest()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        for r in readers:
            assert r.stdout.readline().strip() == want
        maps = [_smaps(r.pid, data) for r in readers]
        size_kb = os.path.getsize(data) // 1024
        for m in maps:
            # the same tmpfs inode, mapped read-only and MAP_SHARED ("r--s")
            assert m["inode"] == os.stat(data).st_ino and m["perms"] == "r--s"
            assert m["Rss"] >= size_kb  # every page mapped ...
            # ... shared with the other reader, none copied (tmpfs pages count as dirty)
            assert m["Shared_Clean"] + m["Shared_Dirty"] == m["Rss"] and m["Anonymous"] == 0
            assert m["Pss"] <= 0.5 * m["Rss"] + 8  # each process is charged half: the same physical pages
        # reader 0 exits: the store stays and reader 1 still reads it intact
        readers[0].communicate("\n\n", timeout=30)
        assert readers[0].wait(timeout=30) == 0
        assert data.exists() and (path / "index.msgpack").exists()
        readers[1].stdin.write("\n")
        readers[1].stdin.flush()
        assert readers[1].stdout.readline().strip() == want
        alone = _smaps(readers[1].pid, data)
        assert alone["Pss"] >= alone["Rss"] - 8  # now the only mapper
        late = PageStore(path)  # a new reader after one exited
        assert hashlib.blake2b(late.array.tobytes()).hexdigest() == want
        late.close()
    finally:
        for r in readers:
            if r.poll() is None:
                r.communicate("\n\n", timeout=30)
    assert data.exists()


def test_one_mapping_per_process_outlives_a_closed_reader(store_dir):
    """Two engines of one process share one mapping (pinned once); closing one leaves the other readable."""
    path, src, records = store_dir
    a = PageStore.create(path, src, records)
    b = PageStore(path)
    assert a.array.ctypes.data == b.array.ctypes.data, "a second mapping would be pinned twice"
    r = records[0]
    expected = bytes(b.view(r.block, r.what, r.idx))
    a.close()
    assert bytes(b.view(r.block, r.what, r.idx)) == expected
    b.close()
    c = PageStore(path)  # the last close unmapped it: a new reader maps afresh
    assert bytes(c.view(r.block, r.what, r.idx)) == expected
    c.close()


def _other_planes(src: Path, records: list[Record]) -> tuple[Path, Record]:
    """A copy of `src` (another checkpoint of the same shapes) that differs in one record the sampled check skips."""
    sampled = set(records[::max(1, len(records) // 8)])
    r = next(r for r in records if r not in sampled)
    data = bytearray(src.read_bytes())
    data[r.offset] ^= 0xFF
    other = src.parent / "other-planes.bin"
    other.write_bytes(bytes(data))
    return other, r


def test_a_store_recorded_for_other_planes_is_refused(store_dir):
    """A directory reused for another checkpoint of the same shapes whose planes differ outside the sampled bytes:
    the identity recorded when writing refuses it (the samples alone served the old planes); a store that recorded
    none cannot show what it holds and is refused as well, unless its directory has the default name, which is the
    planes' id."""
    path, src, records = store_dir
    other, r = _other_planes(src, records)
    store = PageStore.create(path, src, records, identity="aaaa")
    assert store.written and store.identity == "aaaa"
    store.close()
    with pytest.raises(ValueError, match=r"holds planes aaaa, not .*other-planes.bin's planes bbbb: remove it"):
        PageStore.create(path, other, records, identity="bbbb")
    same = PageStore.create(path, src, records, identity="aaaa")
    assert not same.written
    same.close()
    PageStore.destroy(path)
    PageStore.create(path, src, records).close()  # no identity given: none recorded (an old store's index)
    with pytest.raises(ValueError, match="holds unrecorded planes .* remove it"):
        PageStore.create(path, src, records, identity="aaaa")
    unchecked = PageStore.create(path, other, records)  # without identities only the samples are compared
    assert bytes(unchecked.view(r.block, r.what, r.idx)[:1]) != other.read_bytes()[r.offset:r.offset + 1]
    unchecked.close()
    # an unrecorded store under the default name, which is its planes id (written by an older version): trusted
    default = path.parent / "pagedweight-aaaa"
    PageStore.create(default, src, records).close()
    PageStore.create(default, src, records, identity="aaaa").close()
    with pytest.raises(ValueError, match="holds unrecorded planes"):
        PageStore.create(default, src, records, identity="bbbb")
    PageStore.destroy(default)


def _mapped(path: Path) -> list[str]:
    """This process's mappings of `path`'s pages.bin ("... (deleted)" once it was removed)."""
    return [line.split(None, 5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith(str(path / "pages.bin"))]


def test_a_closed_engine_unmaps_its_store(ap_dir, tmp_path):
    """LLM.close drops the engine's hold on the page store: with the last one the process unmaps it (it had no
    close, and the process kept a destroyed store mapped, its tmpfs pages allocated, beside the re-created one). An
    engine that fails to build drops it too."""
    from pagedweight.engine import LLM
    from pagedweight.sampling import SamplingParams

    store = tmp_path / "store"
    llm = LLM(ap_dir, device="cpu", block_size=16, page_store_dir=str(store))
    assert _mapped(store) == [str(store / "pages.bin")]
    llm.close()
    assert _mapped(store) == []
    PageStore.destroy(store)
    again = LLM(ap_dir, device="cpu", block_size=16, page_store_dir=str(store))  # a fresh store, mapped afresh
    assert _mapped(store) == [str(store / "pages.bin")]
    out = again.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out[0].completion_tokens == 2
    again.close()
    assert _mapped(store) == []
    with pytest.raises(ValueError, match="outside the checkpoint's widths"):
        LLM(ap_dir, device="cpu", block_size=16, page_store_dir=str(store), bits=1, activation_reserve=0)
    assert _mapped(store) == []


def test_a_complete_store_opens_without_write_access(tmp_path):
    """A store directory this process may not write (another user's, a read-only mount) opens: only writing a store
    takes the exclusive lock (it opened .lock for writing every time, and failed)."""
    root = os.geteuid() == 0  # root writes anywhere: the reader drops to nobody (it must traverse /dev/shm then)
    if root and not os.access("/dev/shm", os.W_OK):
        pytest.skip("no /dev/shm for a reader of another user")
    base = (Path("/dev/shm") if root else tmp_path) / f"pw-test-ro-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    try:
        sizes = [(3000 + 512 * i, {2: 64 * (i + 1)}) for i in range(3)]
        records = write_planes_file(base / "planes.bin", sizes, parent_bits=2, seed=1)
        os.chmod(base / "planes.bin", 0o644)
        PageStore.create(base / "store", base / "planes.bin", records, identity="aaaa").close()
        names = sorted(p.name for p in (base / "store").iterdir())
        os.chmod(base / "store", 0o555)
        want = (base / "planes.bin").read_bytes()[records[-1].offset:records[-1].offset + records[-1].nbytes]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the reader: no write access to the store's directory
            code = 1
            try:
                os.close(r)
                if root:
                    os.setgid(65534)
                    os.setuid(65534)
                s = PageStore.create(base / "store", base / "planes.bin", records, identity="aaaa")
                ok = bytes(s.view(records[-1].block, records[-1].what, records[-1].idx)) == want and not s.written
                s.close()
                code = 0 if ok else 2
            except BaseException as exc:
                os.write(w, repr(exc).encode())
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            error = f.read()
        assert os.waitpid(pid, 0)[1] == 0, error
        assert sorted(p.name for p in (base / "store").iterdir()) == names
    finally:
        if (base / "store").exists():
            os.chmod(base / "store", 0o755)
        shutil.rmtree(base)


def test_destroy_and_a_second_creator_wait_for_a_writer(store_dir, monkeypatch):
    """`destroy` takes the creators' lock: it removed a store mid-write (the writer failed) and the lock file under
    the writer, so that a second creator took a new lock and wrote beside it. Either order after the writer leaves a
    consistent state: the second creator's store reads the source."""
    import threading

    from pagedweight import page_store

    path, src, records = store_dir
    replace, results, waiting = os.replace, {}, []

    def run(name, f):
        try:
            results[name] = f()
        except BaseException as exc:
            results[name] = exc

    def mid_write(a, b):
        if Path(b).name == "pages.bin" and not waiting:
            for name, f in (("destroy", lambda: PageStore.destroy(path)),
                            ("second", lambda: PageStore.create(path, src, records))):
                t = threading.Thread(target=run, args=(name, f))
                t.start()
                t.join(0.5)
                waiting.append((name, t.is_alive(), t))
        return replace(a, b)

    monkeypatch.setattr(page_store.os, "replace", mid_write)
    first = PageStore.create(path, src, records)  # destroy removed its pages.bin.tmp: FileNotFoundError
    monkeypatch.undo()
    assert [(name, alive) for name, alive, _ in waiting] == [("destroy", True), ("second", True)]
    for _, _, t in waiting:
        t.join(30)
    assert results["destroy"] is None and isinstance(results["second"], PageStore)
    raw = src.read_bytes()
    for store in (first, results["second"]):
        for r in records:
            assert bytes(store.view(r.block, r.what, r.idx)) == raw[r.offset:r.offset + r.nbytes]
        store.close()
    assert not path.exists() or (path / "index.msgpack").exists()  # destroyed last, or written again after it


# ---- progress of large stores (byte_progress) ----

def test_a_large_store_s_bar_counts_every_record_byte_in_steps(store_dir, bars, monkeypatch):
    """Above the threshold one bar over the records' bytes, on stderr, updated every PROGRESS_STEP_BYTES copied (not
    per record) and reaching its total; opening the written store draws none, and a failed write closes its bar."""
    from pagedweight import page_store

    path, src, records = store_dir
    step = 10_000
    monkeypatch.setattr(page_store, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(page_store, "PROGRESS_STEP_BYTES", step)
    store = PageStore.create(path, src, records)
    raw = np.fromfile(src, dtype=np.uint8)
    assert all(np.array_equal(store.view(r.block, r.what, r.idx), raw[r.offset:r.offset + r.nbytes]) for r in records)
    store.close()
    assert len(bars) == 1
    bar = bars[0]
    assert bar.kw["desc"] == "page store" and bar.kw["unit"] == "B" and bar.kw["unit_scale"]
    assert bar.kw["file"] is sys.stderr and bar.kw["disable"] is None  # tqdm's own: silent off a terminal
    assert bar.total == sum(r.nbytes for r in records) == sum(bar.updates) and bar.closed
    assert 1 < len(bar.updates) < len(records)
    assert all(n >= step for n in bar.updates[:-1]) and bar.updates[-1] < step
    PageStore.create(path, src, records).close()  # the store exists: opened, nothing copied
    assert len(bars) == 1
    PageStore.destroy(path)
    with pytest.raises(ValueError, match="outside the source file"):
        PageStore.create(path, src, records + [Record(9, "plane", 0, os.path.getsize(src), 8)])
    assert len(bars) == 2 and bars[1].closed and sum(bars[1].updates) < bars[1].total
    monkeypatch.setattr(page_store, "PROGRESS_MIN_BYTES", sum(r.nbytes for r in records) + 1)
    PageStore.create(path, src, records).close()
    assert len(bars) == 2  # just below the threshold: no bar at all


def test_a_large_store_s_progress_shows_on_a_terminal_and_is_logged_off_one(store_dir, messages, capfd,
                                                                            monkeypatch):
    """A small store is written without a word (below the threshold, even on a terminal); above it a terminal gets
    the bar, and a log (not a terminal: Ray actors', containers') gets no bar but a start and an end line."""
    from pagedweight import page_store

    path, src, records = store_dir
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    PageStore.create(path, src, records).close()
    assert terminal.getvalue() == "" and messages == []
    assert capfd.readouterr() == ("", "")

    PageStore.destroy(path)
    monkeypatch.setattr(page_store, "PROGRESS_MIN_BYTES", 0)
    PageStore.create(path, src, records).close()
    assert "page store" in terminal.getvalue() and "100%" in terminal.getvalue() and messages == []

    PageStore.destroy(path)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    PageStore.create(path, src, records).close()
    # no bar drawn (a bar always holds "%|"; the stream may hold the lines of a loguru sink on stderr, such as the
    # one an earlier test's `pagedweight` main left)
    assert "%|" not in log.getvalue()
    assert len(messages) == 2 and all(m.startswith("page store: ") for m in messages)
    assert str(src) in messages[0] and " GB" in messages[0] and " s (" in messages[1]
