"""Triton kernels for the Comfy quantization formats (quantize, dequantize, quantized linears).

Hand-written placeholder package (no notebook exports it yet): the kernel notebooks will export their
modules here. `import cquant` never imports this package, so it needs neither a GPU nor triton.
The GPU validation and benchmark harness lives in the top-level `kernels/` folder.
"""
