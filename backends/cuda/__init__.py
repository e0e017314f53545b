"""The CuPy GPU backend (`pip install 'hearthlm[gpu-cuda13]'`, or `[gpu-cuda12]`: the CUDA
major of the driver). Importing this package needs no CuPy; making
`backend.CUDABackend()` does, and a CUDA device."""
