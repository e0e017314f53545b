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
