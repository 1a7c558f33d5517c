"""Kernels, grouped by backend, each beside the plain-torch reference it must match:

  ``cpu/``     numba kernels for the CPU (``--kernel-backend numba``)
  ``triton/``  Triton kernels for the GPU (``--kernel-backend triton``)

The backend is chosen in one place, ``layers/backend.py``. Kernels import nothing above
them: a layer or model hands them arrays, addresses and plain parameters.
"""
