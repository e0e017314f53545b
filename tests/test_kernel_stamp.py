"""A cached kernel is recompiled when a jitted function it calls changes in another module of its
folder (backends/cpu/kernel_stamp.py): numba alone stamps a function by its own file, and a
cached caller keeps its callees' old code linked in.

Mutation: `get_source_stamp` returning numba's stamp alone (no siblings) fails it: the second
process loads `f` from the cache and still gets the old `g`'s 1."""
import os
import subprocess
import sys
import textwrap
import time

RUN = textwrap.dedent("""
    import sys
    from pathlib import Path
    from hearthlm.backends.cpu import kernel_stamp
    kernel_stamp.KERNEL_DIRS.add(Path(sys.argv[1]).resolve())
    sys.path.insert(0, sys.argv[1])
    import mod_a
    print(mod_a.f(), mod_a.f.stats.cache_hits.get(mod_a.f.signatures[0], 0) if mod_a.f.signatures else -1)
""")


def _module(path, text):
    path.write_text(textwrap.dedent(text))


def _run(folder, env):
    r = subprocess.run([sys.executable, "-c", RUN, str(folder)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    value, hits = r.stdout.split()
    return int(value), int(hits)


def test_a_callee_edited_in_a_sibling_module_recompiles_the_cached_caller(tmp_path):
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    _module(pkg / "mod_b.py", """
        import numba
        @numba.njit(cache=True)
        def g():
            return 1
    """)
    _module(pkg / "mod_a.py", """
        import numba
        from mod_b import g
        @numba.njit(cache=True)
        def f():
            return g()
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    assert _run(pkg, env) == (1, 0)  # compiled
    assert _run(pkg, env) == (1, 1)  # loaded from the cache: nothing changed
    time.sleep(0.01)
    _module(pkg / "mod_b.py", """
        import numba
        @numba.njit(cache=True)
        def g():
            return 22
    """)
    assert _run(pkg, env) == (22, 0)  # mod_a.py untouched, yet f compiled again with the new g


def _kernels(folder, g_value=1):
    folder.mkdir(parents=True)
    _module(folder / "mod_b.py", f"""
        import numba
        @numba.njit(cache=True)
        def g():
            return {g_value}
    """)
    _module(folder / "mod_a.py", """
        import numba
        from mod_b import g
        @numba.njit(cache=True)
        def f():
            return g()
    """)


def test_a_second_copy_of_the_same_kernels_loads_them_from_the_shared_cache(tmp_path):
    """Two clones of the same sources (different paths, different mtimes) share one compiled copy in
    the content-addressed kernel cache; an edit in a copy compiles anew, beside the old version.

    Mutation: SharedCacheLocator left out of `install` (numba's __pycache__ beside each copy) fails
    the second copy's (1, 1); the cache folder named by the path's hash instead of the content's
    digest fails it too."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["HEARTHLM_KERNEL_CACHE_DIR"] = str(tmp_path / "shared")
    _kernels(tmp_path / "one" / "kernels")
    time.sleep(0.01)
    _kernels(tmp_path / "two" / "kernels")
    assert _run(tmp_path / "one" / "kernels", env) == (1, 0)  # compiled
    assert _run(tmp_path / "two" / "kernels", env) == (1, 1)  # the same sources elsewhere: loaded
    assert not list((tmp_path / "two" / "kernels").glob("__pycache__/*.nbi"))
    _module(tmp_path / "two" / "kernels" / "mod_b.py", """
        import numba
        @numba.njit(cache=True)
        def g():
            return 22
    """)
    assert _run(tmp_path / "two" / "kernels", env) == (22, 0)
    assert _run(tmp_path / "one" / "kernels", env) == (1, 1)  # the first version is still there
    assert len(list((tmp_path / "shared").glob("kernels-*"))) == 2


def test_prune_keeps_the_newest_versions_and_any_in_use(tmp_path):
    """Mutation: sorting oldest first removes the newest versions; dropping the idle check removes
    one another process used a minute ago."""
    from hearthlm.backends.cpu import kernel_stamp
    now = time.time()
    ages = {"cpu-a": 7300, "cpu-b": 60, "cpu-c": 180, "cpu-d": 7400, "cpu-e": 120, "cpu-f": 240}
    for name, age in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age, now - age))
    (tmp_path / "other-a").mkdir()
    gone = kernel_stamp.prune(tmp_path, "cpu", keep=2)  # past the newest 2, the used-this-hour stay
    assert sorted(p.name for p in gone) == ["cpu-a", "cpu-d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-b", "cpu-c", "cpu-e", "cpu-f", "other-a"]
