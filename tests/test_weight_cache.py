"""The packed-weight cache on disk (runtime/weights.py's WeightCache, the CPU backend's
export/import): written on a first open, mapped on the next with the same outputs; a corrupt
or stale file is rebuilt, never used; a directory that cannot be written means no cache; two
processes share one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import vmflags_of
from gguf import GGMLQuantizationType as T
from tiny_gguf import write_tiny

from hearthlm import SyncSession
from hearthlm.backends.cpu.backend import CPUBackend
from hearthlm.model_zoo.gguf_file import GGUFFile
from hearthlm.runtime import array_file, weight_cache
from hearthlm.runtime.weight_cache import CACHE_FORMAT, WeightCache, cache_dir, default_cache_dir

PROMPT = [5, 40, 77, 120, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # Q4_1: a layout with per-row minimums (m); q/k/v are stacked by fusion
    return write_tiny(tmp_path_factory.mktemp("m") / "tiny.gguf", n_embd=128, n_ff=256, qtype=T.Q4_1)


def run(model, cache, n=6) -> tuple[list[int], str]:
    with SyncSession(str(model), weight_cache=cache, n_ctx=64) as s:
        ids = s.generate(PROMPT, max_tokens=n, temperature=0, ignore_eos=True).token_ids
        return ids, s.stats()["weight_cache"]["cpu"]


def cache_file(model, d: Path) -> Path:
    with GGUFFile.open(model) as f:
        return WeightCache(d / "weights", f.identity()).path(CPUBackend())


def test_written_then_mapped_with_the_same_outputs(model, tmp_path):
    ref, state = run(model, False)
    assert state == "off"
    ids, state = run(model, tmp_path)
    assert (ids, state) == (ref, "written")
    f = cache_file(model, tmp_path)
    assert f.stat().st_size > 0 and not list(f.parent.glob(".tmp-*"))
    ids, state = run(model, tmp_path)
    assert (ids, state) == (ref, "hit")


def test_weights_left_in_the_model_file_do_not_rewrite_it(tmp_path):
    """F16 matrices are used where they lie in the model file (not cached); their q/k/v stack
    is a copy and is: the second start maps it and writes nothing."""
    f32 = write_tiny(tmp_path / "f16.gguf", qtype=T.F16)
    ref, state = run(f32, tmp_path)
    assert state == "written"
    before = cache_file(f32, tmp_path).stat().st_mtime_ns
    assert run(f32, tmp_path) == (ref, "hit")
    assert cache_file(f32, tmp_path).stat().st_mtime_ns == before


def test_mapped_pages_belong_to_the_file(model, tmp_path, monkeypatch):
    """A file over weight_cache.PRIVATE_UNDER of memory (here: any) is mapped, never copied."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs /proc/self/smaps")
    monkeypatch.setattr(weight_cache, "PRIVATE_UNDER", 0)
    run(model, tmp_path)
    with SyncSession(str(model), weight_cache=tmp_path, n_ctx=64) as s:
        s.generate(PROMPT, max_tokens=2, temperature=0)
        name = cache_file(model, tmp_path).name
        rss = anon = 0
        cur = False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if "-" in line.split()[0] and len(line.split()) >= 5:
                cur = line.endswith(name)
            elif cur and line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif cur and line.startswith("Anonymous:"):
                anon += int(line.split()[1])
        assert rss > 0 and anon == 0, (rss, anon)  # read through the mapping, never copied


def _smaps_of(name: str) -> int:
    """Resident KiB of this process's mappings of files named `name`."""
    rss, cur = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0] and len(line.split()) >= 5:
            cur = line.endswith(name)
        elif cur and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


def test_a_small_file_is_read_into_memory_of_its_own(model, tmp_path):
    """Under PRIVATE_UNDER of memory the cache file is read, not mapped (its arrays in huge pages
    where Linux has them): the same tokens, no page of the file mapped. Mutation: load() without
    `private=` maps it (the file shows in smaps) and fails."""
    if not Path("/proc/self/smaps").exists() or not array_file.HUGE_PAGES:
        pytest.skip("needs /proc/self/smaps and madvise(MADV_HUGEPAGE)")
    ref, _ = run(model, False)
    assert run(model, tmp_path)[1] == "written"
    with SyncSession(str(model), weight_cache=tmp_path, n_ctx=64) as s:
        ids = s.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids
        assert s.stats()["weight_cache"]["cpu"] == "hit" and ids == ref
        assert _smaps_of(cache_file(model, tmp_path).name) == 0


@pytest.mark.parametrize("private", [True, False])
def test_private_read_does_not_follow_the_file(tmp_path, private, monkeypatch):
    """Read privately, the arrays are a copy: a later write into the file leaves them as read
    (mapped, MAP_PRIVATE pages still show it: the case that shows the test can tell). A file cut
    short between its size and its read is corrupt, not half-read. Mutation: read() ignoring
`private` (always mapped) fails the private case."""
    f = tmp_path / "a.bin"
    array_file.write(f, b"TESTFILE", 1, {}, {"x": np.arange(4096, dtype=np.int64)})
    _, arrays = array_file.read(f, b"TESTFILE", 1, private=private)
    x = arrays["x"]
    raw = bytearray(f.read_bytes())
    at = raw.find(np.int64(7).tobytes() + np.int64(8).tobytes())
    raw[at:at + 8] = np.int64(-1).tobytes()
    with open(f, "r+b") as fh:  # in place, as another writer would (the cache itself renames)
        fh.write(raw)
    assert x[7] == (7 if private else -1) and x.flags.writeable
    if private and array_file.HUGE_PAGES:
        def short_open(path, mode="rb"):
            fh = open(path, mode)
            fh.readinto = lambda buf: 10
            return fh
        monkeypatch.setattr(array_file, "open", short_open, raising=False)
        with pytest.raises(array_file.ArrayFileError, match="shorter"):
            array_file.read(f, b"TESTFILE", 1, private=True)


def test_private_read_is_private_anonymous_memory_that_asks_for_huge_pages(tmp_path):
    """The private read's memory is a private anonymous mapping advised for huge pages. Python's
    mmap(-1, n) is a *shared* anonymous mapping, i.e. shmem, which THP ignores unless
    shmem_enabled allows it ("never" here): the weights had no huge page at all, and decode read
    them 8-13% slower (1-token steps of all three models; plain reads 19 -> 24 GB/s). Mutation
    seen to fail: the mapping without flags (VmFlags "sh")."""
    if not Path("/proc/self/smaps").exists() or not array_file.HUGE_PAGES:
        pytest.skip("needs /proc/self/smaps and madvise(MADV_HUGEPAGE)")
    f = tmp_path / "a.bin"
    array_file.write(f, b"TESTFILE", 1, {}, {"x": np.arange(1 << 20, dtype=np.int64)})
    _, arrays = array_file.read(f, b"TESTFILE", 1, private=True)
    flags = vmflags_of(arrays["x"].ctypes.data)
    assert "sh" not in flags and "hg" in flags, flags
    np.testing.assert_array_equal(arrays["x"], np.arange(1 << 20))


@pytest.mark.parametrize("slow", [True, False])
def test_huge_pages_that_fault_in_slowly_are_given_up_for_the_rest(tmp_path, monkeypatch, slow):
    """A private read faults its huge pages in one at a time while they come quickly; once two
    in a row come slower than SLOW_HUGE_PAGES (a VM whose host backs each fresh 2 MiB page
    anew: 486 MB took 7.4 s once here, against 0.3 s in 4 KiB pages), the rest of the mapping
    is advised off them (VmFlags "nh"), and the bytes are read whole either way. Mutations
    seen to fail: never giving them up (the slow case keeps "hg" to the end); giving them up
    whatever the rate (the quick case shows "nh")."""
    if not Path("/proc/self/smaps").exists() or not array_file.HUGE_PAGES:
        pytest.skip("needs /proc/self/smaps and madvise(MADV_HUGEPAGE)")
    monkeypatch.setattr(array_file, "SLOW_HUGE_PAGES", 1e18 if slow else 0.0)  # every chunk slow / none
    f = tmp_path / "a.bin"
    array_file.write(f, b"TESTFILE", 1, {}, {"x": np.arange(1 << 20, dtype=np.int64)})  # 8 MiB: 4 huge pages
    _, arrays = array_file.read(f, b"TESTFILE", 1, private=True)
    x = arrays["x"]
    np.testing.assert_array_equal(x, np.arange(1 << 20))
    tail = vmflags_of(x[-1:].ctypes.data)
    assert "hg" in vmflags_of(x.ctypes.data)  # the first chunk: asked for, whatever its rate
    assert ("nh" in tail and "hg" not in tail) if slow else ("hg" in tail and "nh" not in tail), tail


def _corruptions(f: Path):
    data = f.read_bytes()
    head_index = int.from_bytes(data[24:32], "little")  # data offset
    yield "bad magic", b"XX" + data[2:]
    yield "truncated", data[: len(data) // 2]
    yield "empty", b""
    yield "flipped data byte", data[:head_index + 100] + bytes([data[head_index + 100] ^ 0x10]) + data[head_index + 101:]
    yield "garbage index", data[:40] + b"{" * 20 + data[60:]
    yield "other format", data[:8] + (CACHE_FORMAT + 1).to_bytes(4, "little") + data[12:]


def test_corrupt_file_is_rebuilt(model, tmp_path):
    ref, _ = run(model, False)
    run(model, tmp_path)
    f = cache_file(model, tmp_path)
    good = f.read_bytes()
    with GGUFFile.open(model) as g:
        identity = g.identity()
    for what, bad in _corruptions(f):
        f.write_bytes(bad)
        _, state = WeightCache(tmp_path / "weights", identity).load(CPUBackend())
        assert state in ("corrupt", "stale"), what
        ids, state = run(model, tmp_path)
        assert (ids, state) == (ref, "written"), what
        assert f.read_bytes() == good, what  # rebuilt as it was
    assert run(model, tmp_path) == (ref, "hit")


def test_stale_file_is_rebuilt(model, tmp_path, monkeypatch):
    ref, _ = run(model, False)
    run(model, tmp_path)
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the model file changed
    assert run(model, tmp_path) == (ref, "written")
    assert run(model, tmp_path) == (ref, "hit")
    monkeypatch.setattr(CPUBackend, "weight_layout", "cpu-qtypes-test")  # a new packing layout
    assert run(model, tmp_path) == (ref, "written")


def test_unwritable_directory_means_no_cache(model, tmp_path):
    """A cache path under a regular file, and a directory nothing can be written to (a child
    process under a file-size limit of 0: RLIMIT_FSIZE binds root, whom permission bits do
    not, and CI runs as root): a good file there is still mapped ("hit"); without one the
    session runs uncached ("unwritable") and the failed write leaves no temporary file.
    Mutations: array_file.write no longer unlinking its temporary file on failure leaves a
    .tmp-* behind; WeightCache.save letting its OSError out fails the open (both as root too)."""
    ref, _ = run(model, False)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert run(model, blocker / "cache") == (ref, "unwritable")
    d = tmp_path / "ro"
    assert run(model, d) == (ref, "written")
    assert _no_writes_child(model, d) == [ref, "hit"]
    cache_file(model, d).unlink()
    assert _no_writes_child(model, d) == [ref, "unwritable"]
    assert not list((d / "weights").iterdir())
    if os.geteuid() != 0:  # permission bits too, where they bind
        (d / "weights").chmod(0o555)
        try:
            assert run(model, d) == (ref, "unwritable")
        finally:
            (d / "weights").chmod(0o755)


def _no_writes_child(model, d: Path) -> list:
    """_CHILD's [ids, weight-cache state], run where no file can grow past 0 bytes: a write
    fails with EFBIG (SIGXFSZ ignored, as it would otherwise kill the process)."""
    limit = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n")
    r = subprocess.run([sys.executable, "-c", limit + _CHILD, str(model), str(d)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cache_dir_option_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HEARTHLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert default_cache_dir() == tmp_path / "xdg" / "hearthlm"
    assert cache_dir(None) == default_cache_dir() / "weights"
    assert cache_dir(False) is None and cache_dir("off") is None
    assert cache_dir(tmp_path) == tmp_path / "weights"
    monkeypatch.setenv("HEARTHLM_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir(None) == tmp_path / "env" / "weights"
    monkeypatch.setenv("HEARTHLM_CACHE_DIR", "off")
    assert cache_dir(None) is None


_CHILD = r"""
import json, sys
from hearthlm import SyncSession
with SyncSession(sys.argv[1], weight_cache=sys.argv[2], n_ctx=64) as s:
    ids = s.generate([5, 40, 77, 120, 9], max_tokens=6, temperature=0, ignore_eos=True).token_ids
    print(json.dumps([ids, s.stats()["weight_cache"]["cpu"]]))
"""


def test_two_processes_share_one_cache(model, tmp_path):
    ref, _ = run(model, False)

    def start():
        return subprocess.Popen([sys.executable, "-c", _CHILD, str(model), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(p):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    both = [start(), start()]  # at once, on an empty cache: each may write it, neither breaks
    outs = [result(p) for p in both]
    assert all(ids == ref and state in ("written", "hit") for ids, state in outs), outs
    both = [start(), start()]  # then both map the one file
    assert [result(p) for p in both] == [[ref, "hit"]] * 2
    assert not list((tmp_path / "weights").glob(".tmp-*"))


def test_moe_experts_are_cached(tmp_path, monkeypatch):
    """Stacked expert weights (qwen3moe) go into the cache, one packed weight per expert: the
    second start maps them all, packing nothing, with the same outputs."""
    from parity.models import write

    import hearthlm.backends.cpu.backend as cpu
    moe = write(tmp_path / "moe.gguf", "qwen3moe", qtype=T.Q8_0)
    ref, state = run(moe, False)
    assert run(moe, tmp_path) == (ref, "written")
    monkeypatch.setattr(cpu, "pack_weight", lambda *a, **k: pytest.fail("a weight was packed again"))
    ids, state = run(moe, tmp_path)
    assert (ids, state) == (ref, "hit")


def test_a_write_drops_the_files_of_models_gone_or_changed(model, tmp_path):
    """Writing one model's file drops the others whose model file was deleted, or changed (size
    or mtime), or that no longer read as this format; a file whose model is still there as it
    was stays. Mutations seen to fail: prune not called from save; the mtime check dropped (the
    changed model's file kept); every other file dropped (the kept model's file gone)."""
    import shutil
    kept, gone, changed = (shutil.copy(model, tmp_path / f"{n}.gguf") for n in ("kept", "gone", "changed"))
    for m in (kept, gone, changed):
        assert run(m, tmp_path)[1] == "written"
    junk = tmp_path / "weights" / ("0" * 24 + ".cpu.hlw")
    junk.write_bytes(b"not a weight file")
    other_backend = tmp_path / "weights" / ("1" * 24 + ".cuda.hlw")
    other_backend.write_bytes(b"another backend's: not this one's to judge")
    files = {m: cache_file(m, tmp_path) for m in (kept, gone, changed)}
    os.unlink(gone)
    os.utime(changed, ns=(1, 1))
    assert all(f.exists() for f in files.values())
    assert run(model, tmp_path)[1] == "written"  # a fourth model's first open writes, and prunes
    assert files[kept].exists() and cache_file(model, tmp_path).exists() and other_backend.exists()
    assert not files[gone].exists() and not files[changed].exists() and not junk.exists()
    assert run(kept, tmp_path)[1] == "hit"
