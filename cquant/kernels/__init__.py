"""Triton kernels for the Comfy quantization formats (quantize, dequantize, quantized linears).

Hand-written (no notebook exports this file). The kernel notebooks (`nbs/3*_kernels_*.ipynb`) export the
modules of this package; `cquant.kernels.dispatch.enable()` registers them as the layouts' fast paths.
`import cquant` calls it only when a CUDA GPU and triton are present (`CQUANT_KERNELS=0` opts out), so it
needs neither. On CPU the kernels run through Triton's interpreter: set `TRITON_INTERPRET=1` before anything
imports triton (the tests do, in `tests/conftest.py`). The GPU validation and benchmark harness lives in the
top-level `kernels/` folder.
"""
