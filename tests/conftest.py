"""Session-wide test setup.

Triton reads TRITON_INTERPRET when kernels are defined, and importing comfy-kitchen (whose triton backend
defines kernels) before it is set leaves cquant's kernels unable to run under the CPU interpreter. So on
machines without CUDA the interpreter is switched on here, before any test module imports anything.
"""
import os
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
