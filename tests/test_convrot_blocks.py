"""ConvRot quantize / dequantize in row blocks against comfy-kitchen 0.2.40 eager, bit for bit.

cquant rotates and quantizes ConvRot weights in cache-sized row blocks (`cquant.int8._rotation_blocks`), each block
one GEMM of the same shape class as kitchen's whole-tensor GEMM. The shapes here span several blocks (and an uneven
tail), so a block boundary that changed a bit would show. kitchen runs in this process on this machine: the
comparison never depends on which CPU or BLAS kernel computed the sums.
"""
from __future__ import annotations
import zlib
import pytest
import torch

ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (the bit-exactness oracle) is not installed")
from comfy_kitchen.tensor import QuantizedTensor as KQT  # noqa: E402
from comfy_kitchen.backends.eager.quantization import dequantize_int8_convrot_weight  # noqa: E402

import cquant as cq
from cquant.int8 import _rotation_blocks
from cquant.tensor import test_bits as assert_bits

DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SHAPES = ((2304, 1024), (1100, 2048))       # 2 and 2+ blocks at g=256 (the second has a merged tail)


def weight(shape, dtype, kind):
    """N(0,1); `outlier`: 8 input columns x12; `wide`: rows scaled by 2^e, e in [-8, 6] (fp16 int8 scales stay normal:
    below that cquant departs from kitchen on purpose, see test_kitchen_compat)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{shape}{dtype}{kind}".encode()))
    w = torch.randn(shape, generator=g)
    if kind == "outlier": w[:, torch.randperm(shape[1], generator=g)[:8]] *= 12
    if kind == "wide": w = w * torch.exp2(torch.randint(-8, 7, (shape[0], 1), generator=g).float())
    return w.to(dtype)


def test_shapes_span_blocks():
    for N, K in SHAPES: assert len(_rotation_blocks(N, K, 256)) >= 2, (N, K)


def kitchen(w, fmt, g):
    if fmt == "convrot_w4a4": return KQT.from_float(w, "TensorCoreConvRotW4A4Layout", convrot_groupsize=g)
    return KQT.from_float(w, "TensorWiseINT8Layout", per_channel=True, convrot=True, convrot_groupsize=g)


def ours(w, fmt, g):
    if fmt == "convrot_w4a4": return cq.quantize(w, fmt, convrot_groupsize=g)
    return cq.quantize(w, fmt, convrot=True, convrot_groupsize=g)


@pytest.mark.parametrize("kind", ("outlier", "wide"))
@pytest.mark.parametrize("dtype", tuple(DT), ids=DT.get)
@pytest.mark.parametrize("g", (16, 256))
@pytest.mark.parametrize("fmt", ("int8_tensorwise", "convrot_w4a4"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_blocked_convrot_matches_kitchen(shape, fmt, g, dtype, kind):
    w = weight(shape, dtype, kind)
    qt, kt = ours(w, fmt, g), kitchen(w, fmt, g)
    theirs = kt.state_dict("weight")
    for k, t in qt.state_dict("").items():
        if k.endswith("comfy_quant"): continue
        assert_bits(t, theirs[k], f"{fmt} g={g} {DT[dtype]} {kind} {shape}: {k}")
    q, scale = theirs["weight"], theirs["weight_scale"]
    for out in DT:
        if fmt == "convrot_w4a4": ref = ck.dequantize_convrot_w4a4_weight(q, scale, g, 64, out)
        else: ref = dequantize_int8_convrot_weight(q, scale, g).to(out)
        assert_bits(qt.dequantize(out), ref, f"{fmt} g={g} {DT[dtype]} {kind} {shape}: dequantize -> {DT[out]}")
