"""The CuPy GPU backend (`pip install 'hearthlm[gpu]'`). Importing this package needs no
CuPy; making `backend.CUDABackend()` does, and a CUDA device."""
