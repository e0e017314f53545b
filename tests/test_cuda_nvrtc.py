"""Every .cu module compiled by NVRTC exactly as CuPy's RawModule compiles it on the GPU machine,
no GPU needed: the same source string (modules.source, local headers inlined), modules.OPTIONS
and what CuPy adds itself: -ftz=true, -arch=sm_XX (a cubin for the device's compute capability),
--device-as-default-execution-space, and its include paths where CuPy is installed. test_cuda.py
compiles the same sources with nvcc, every warning an error; this one is what the GPU actually
runs: NVRTC has no C++ standard headers, and -ftz / -default-device change what compiles and how.
Here a warning in NVRTC's log fails too, and every kernel that ops.py launches must be in the cubin.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (pip install nvidia-cuda-nvrtc; CuPy's [ctk] extra
installs it), a CUDA toolkit (CUDA_PATH, /usr/local/cuda) or HEARTHLM_NVRTC=/path/libnvrtc.so;
without one the test skips and says so."""
import ctypes
import ctypes.util
import glob
import os
import sys

import pytest
from test_cuda_launch import SIGS

from hearthlm.backends.cuda.modules import CU_FILES, OPTIONS, source

ARCHS = (90, 75)  # the lent GPU (H100 / H200), and the oldest that CUDA 13 compiles for


def _candidates():
    if os.environ.get("HEARTHLM_NVRTC"):
        yield os.environ["HEARTHLM_NVRTC"]
    try:  # how CuPy 14 finds it
        from cuda.pathfinder import load_nvidia_dynamic_lib
        yield load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:
        pass
    for base in sys.path:  # the pip wheels: CUDA 13's nvidia/cu13/lib, CUDA 12's nvidia/cuda_nvrtc/lib
        for pat in ("nvidia/cu1*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            yield from sorted(glob.glob(os.path.join(base or ".", pat)), reverse=True)
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            yield from sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), reverse=True)
    if ctypes.util.find_library("nvrtc"):
        yield ctypes.util.find_library("nvrtc")


def _load():
    tried = []
    for path in _candidates():
        if not path or ".alt." in path or "builtins" in path:
            continue
        try:  # its builtins first: libnvrtc dlopens them by name, and a wheel's dir is on no search path
            for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
            lib.nvrtcVersion  # noqa: B018 (the lookup is the check)
        except (OSError, AttributeError) as e:
            tried.append(f"{path}: {e}")
            continue
        return lib, path
    return None, "; ".join(tried)


class NVRTC:
    def __init__(self, lib):
        self.lib = lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        self.version = (major.value, minor.value)
        n = ctypes.c_int()
        self._check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)))
        archs = (ctypes.c_int * n.value)()
        self._check(lib.nvrtcGetSupportedArchs(archs))
        self.archs = list(archs)

    def _check(self, rc):
        if rc != 0:
            raise RuntimeError(self.lib.nvrtcGetErrorString(rc).decode())

    def compile(self, src: str, name: str, options: list[str]) -> tuple[int, str, bytes]:
        """(NVRTC's result code, its log, the cubin or b'')."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None))
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
            log = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, log))
            cubin = b""
            if rc == 0:
                self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
                buf = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetCUBIN(prog, buf))
                cubin = buf.raw
            return rc, log.value.decode(errors="replace"), cubin
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def nvrtc():
    lib, where = _load()
    if lib is None:
        pytest.skip("no NVRTC library to compile the kernels as CuPy does (pip install nvidia-cuda-nvrtc, "
                    "or a CUDA toolkit, or HEARTHLM_NVRTC=/path/libnvrtc.so)" + (f"; tried {where}" if where else ""))
    n = NVRTC(lib)
    print(f"NVRTC {n.version[0]}.{n.version[1]} from {where}")
    return n


def cupy_front_options() -> list[str]:
    """RawModule(code, options=OPTIONS)'s options after CuPy's own (cupy/_core/core.pyx,
    assemble_cupy_compiler_options): its CCCL include paths, OPTIONS, --std=c++17 where OPTIONS
    name no standard, its header and CUDA's include paths. From CuPy itself where it is installed."""
    try:
        from cupy._core import core
        return list(core.assemble_cupy_compiler_options(tuple(OPTIONS)))
    except Exception:  # no CuPy (or one without that function, or without CUDA headers)
        opts = list(OPTIONS)
        if not any("-std=" in o for o in opts):
            opts.append("--std=c++17")
        return opts  # no include paths: the sources include nothing (NVRTC has no standard headers)


def cupy_options(arch: int) -> list[str]:
    """...then cupy/cuda/compiler.py's: _compile_with_cache_cuda appends -ftz=true, and
    _compile_using_nvrtc_no_warning the architecture (-arch=sm_XX, a cubin, where NVRTC knows
    the device's arch) and --device-as-default-execution-space (without jitify)."""
    return cupy_front_options() + ["-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space"]


def test_cupy_options_are_what_modules_asks_for():
    opts = cupy_options(90)
    assert opts.index("-ftz=true") > max(opts.index(o) for o in OPTIONS)  # NVRTC takes the last one
    assert sum("-std=" in o for o in opts) == 1


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("name", CU_FILES)
def test_kernels_compile_with_nvrtc_as_cupy_does(nvrtc, name, arch):
    if arch not in nvrtc.archs:
        pytest.skip(f"NVRTC {nvrtc.version} does not compile for sm_{arch} (it does {nvrtc.archs})")
    src = source(name)
    rc, log, cubin = nvrtc.compile(src, name, cupy_options(arch))
    assert rc == 0, f"NVRTC {nvrtc.version} failed on {name} for sm_{arch}:\n{log[-6000:]}"
    assert "warning" not in log.lower(), f"NVRTC warns on {name} for sm_{arch}:\n{log[-6000:]}"
    assert cubin[:4] == b"\x7fELF"
    kernels = [fn for f, fn in SIGS if f == name]
    assert kernels, f"no kernel signatures read from {name}"
    missing = [fn for fn in kernels if b"\0" + fn.encode() + b"\0" not in cubin]
    assert not missing, f"{name}: kernels not in the cubin: {missing}"
