"""Bit-exact compatibility of cquant with comfy-kitchen 0.2.40 (eager), the reference implementation.

For every format (fp8 e4m3/e5m2, nvfp4, mxfp8, int8 tensor-wise / per-row / ConvRot 16, 64, 256), every input
dtype (fp32, bf16, fp16) and a set of shapes (odd, padded, aligned):

- `cq.quantize` writes exactly kitchen's bytes: the file entries of `qt.state_dict('')` against kitchen's
  `QuantizedTensor.state_dict('weight')` (same key names, dtype, shape and bytes);
- cquant decodes kitchen's tensors (loaded through `cq.load_quantized` from kitchen's state dict plus a
  ComfyUI-style `comfy_quant`, also with uint8-stored block scales) exactly as kitchen does, for every
  output dtype;
- kitchen decodes cquant's files (a kitchen `QuantizedTensor` built from cquant's state dict the way ComfyUI's
  loader builds it) exactly as cquant does;
- the fp8 and int8 linears equal kitchen's eager linears bit for bit;
- where cquant deliberately differs (all-zero weights: kitchen NaN, cquant zeros; small fp16 weights: fp8's 1/scale
  overflowing fp16, nvfp4's global scale flushing to 0; fp16 output with a scale below fp16's normal range for fp8
  and nvfp4) the difference is asserted explicitly. `kitchen_reference` is the one place that says what cquant must decode where it departs from kitchen.

The 4096x4096 cases are marked slow: run them with `pytest -m slow` or `CQUANT_SLOW=1`.
"""
from __future__ import annotations
import dataclasses, math, os, zlib
import pytest
import torch
import torch.nn.functional as F

ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (the bit-exactness oracle, pip install comfy-kitchen==0.2.40) is not installed")
from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight  # noqa: E402
from comfy_kitchen.tensor import (QuantizedTensor as KQT, TensorCoreFP8Layout, TensorCoreNVFP4Layout,
                                  TensorCoreMXFP8Layout, TensorWiseINT8Layout)

import cquant as cq
from cquant.tensor import same_bits, test_bits as assert_bits   # alias: pytest would collect test_bits

EXPECTED_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SHAPES = ((1, 1), (33, 50), (129, 130), (64, 256))
ROT_SHAPES = ((64, 256), (33, 64), (129, 192), (17, 512))   # K divisible by the rotation group
KINDS = ("gauss", "wide")


# ----------------------------------------------------------------------------------------------------------------
# The variants: cquant format + options, and the kitchen layout + keyword arguments that make the same tensor.
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    id: str
    fmt: str                 # cquant / comfy_quant format name
    opts: dict               # cq.quantize options
    k_layout: str            # kitchen layout registry name
    k_kw: dict               # kitchen Layout.quantize keyword arguments
    group: int = 1           # K must be a multiple of this

    @property
    def convrot(self) -> bool: return bool(self.opts.get("convrot", False))

    @property
    def config(self) -> dict:
        "The comfy_quant a ComfyUI writer emits for this variant."
        cfg = {"format": self.fmt}
        if self.convrot: cfg.update(convrot=True, convrot_groupsize=self.opts["convrot_groupsize"])
        return cfg

    def shapes(self):
        return tuple(s for s in (ROT_SHAPES if self.convrot else SHAPES) if s[1] % self.group == 0)


def _rot(g): return Variant(f"int8_convrot{g}", "int8_tensorwise", {"convrot": True, "convrot_groupsize": g},
                            "TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": g}, g)

VARIANTS = (
    Variant("float8_e4m3fn", "float8_e4m3fn", {}, "TensorCoreFP8Layout", {"dtype": torch.float8_e4m3fn}),
    Variant("float8_e5m2", "float8_e5m2", {}, "TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}),
    Variant("nvfp4", "nvfp4", {}, "TensorCoreNVFP4Layout", {}),
    Variant("mxfp8", "mxfp8", {}, "TensorCoreMXFP8Layout", {}),
    Variant("int8", "int8_tensorwise", {}, "TensorWiseINT8Layout", {}),
    Variant("int8_per_row", "int8_tensorwise", {"per_row": True}, "TensorWiseINT8Layout", {"per_channel": True}),
    _rot(16), _rot(64), _rot(256),
)
VBYID = {v.id: v for v in VARIANTS}
FP8_VARIANTS = [VBYID["float8_e4m3fn"], VBYID["float8_e5m2"]]
INT8_VARIANTS = [v for v in VARIANTS if v.fmt == "int8_tensorwise"]


def need(fmt: str):
    "The registered Format of `fmt`: every expected format must be registered (a missing one is a failure)."
    assert fmt in cq.FORMATS, f"format {fmt!r} is not registered in cq.FORMATS (have {sorted(cq.FORMATS)})"
    return cq.FORMATS[fmt]


def cases(variants, kinds=KINDS, dtypes=DTYPES):
    out = []
    for v in variants:
        for shape in v.shapes():
            for dt in dtypes:
                for kind in kinds:
                    out.append(pytest.param(v, shape, dt, kind, id=f"{v.id}-{DT[dt]}-{shape[0]}x{shape[1]}-{kind}"))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def make_weight(shape, dtype, kind="gauss", seed=0) -> torch.Tensor:
    """Deterministic test weights. `gauss`: N(0,1). `wide`: N(0,1) rows scaled by 2^e, e in [-14, 6], with some
    exact zeros and negative zeros (exercises per-row / per-block scales, fp8 and fp16 subnormals, empty blocks)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{shape}{dtype}{kind}{seed}".encode()))
    w = torch.randn(shape, generator=g)
    if kind == "wide":
        w = w * torch.exp2(torch.randint(-14, 7, (shape[0], 1), generator=g).float())
        flat = w.view(-1)
        if flat.numel() >= 8: flat[1], flat[5] = 0.0, -0.0
    return w.to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# kitchen side
# ----------------------------------------------------------------------------------------------------------------
def kitchen_quantize(v: Variant, w: torch.Tensor) -> KQT:
    return KQT.from_float(w, v.k_layout, **v.k_kw)


def kitchen_file(v: Variant, w: torch.Tensor, prefix="m.") -> dict:
    "kitchen's state dict for the module `prefix` (suffixes appended to prefix+'weight', as ComfyUI does) + comfy_quant."
    sd = dict(kitchen_quantize(v, w).state_dict(prefix + "weight"))
    sd[prefix + "comfy_quant"] = cq.encode_json(v.config)
    return sd


def kitchen_load(sd: dict, prefix: str, shape, dtype) -> KQT:
    """A kitchen QuantizedTensor from file entries, the way ComfyUI's loader builds it (reference/comfyui_loader.md
    §2): scales popped per format, block scales reinterpreted with .view(), orig_dtype = the compute dtype."""
    cfg = cq.decode_json(sd[prefix + "comfy_quant"])
    fmt, w = cfg["format"], sd[prefix + "weight"]
    kw = dict(orig_dtype=dtype, orig_shape=tuple(shape))
    if fmt in ("float8_e4m3fn", "float8_e5m2"):
        return KQT(w, "TensorCoreFP8Layout", TensorCoreFP8Layout.Params(scale=sd[prefix + "weight_scale"], **kw))
    if fmt == "nvfp4":
        return KQT(w.view(torch.uint8), "TensorCoreNVFP4Layout", TensorCoreNVFP4Layout.Params(
            scale=sd[prefix + "weight_scale_2"], block_scale=sd[prefix + "weight_scale"].view(torch.float8_e4m3fn), **kw))
    if fmt == "mxfp8":
        return KQT(w.view(torch.float8_e4m3fn), "TensorCoreMXFP8Layout", TensorCoreMXFP8Layout.Params(
            scale=sd[prefix + "weight_scale"].view(torch.float8_e8m0fnu), **kw))
    if fmt == "int8_tensorwise":
        p = cfg.get("params") if isinstance(cfg.get("params"), dict) else {}
        convrot = cfg.get("convrot", p.get("convrot", False))
        group = int(cfg.get("convrot_groupsize", p.get("convrot_groupsize", 256)))
        return KQT(w, "TensorWiseINT8Layout", TensorWiseINT8Layout.Params(
            scale=sd[prefix + "weight_scale"], convrot=bool(convrot), convrot_groupsize=group, **kw))
    raise AssertionError(f"no kitchen loader for {fmt}")


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    "Where two same-shape tensors first differ (bytes), as a short reproducible description."
    if a.shape != b.shape or a.dtype != b.dtype: return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ne = (a.contiguous().reshape(-1).view(torch.uint8) != b.contiguous().reshape(-1).view(torch.uint8)).view(-1, a.element_size()).any(1).nonzero()
    if len(ne) == 0: return "equal"
    i = int(ne[0]); idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), a.shape)) if a.dim() else ()
    return f"{len(ne)}/{a.numel()} differ, first at {idx}: {a.reshape(-1)[i].float().item()!r} vs {b.reshape(-1)[i].float().item()!r}"


def compare_entries(ours: dict, theirs: dict, what: str):
    "Key sets equal and every entry byte-identical (dtype, shape, bytes)."
    assert sorted(ours) == sorted(theirs), f"{what}: keys {sorted(ours)} vs kitchen {sorted(theirs)}"
    bad = [f"{k}: {first_diff(ours[k], theirs[k])}" for k in sorted(ours) if not same_bits(ours[k], theirs[k])]
    assert not bad, f"{what}: cquant vs kitchen: " + "; ".join(bad)


# fp16 output with a scale below fp16's normal range (2^-14), SPEC's "fp16 scale underflow" (see kitchen_reference).
# nvfp4 decoded to fp16: kitchen forms the block multiplier as fp16(s) * fp16(b): when the global scale s is below
# fp16's normal range (s < 2^-14, i.e. a weight max |w| below ~0.16) fp16(s) keeps only a few bits and the decode is off
# by up to ~1% (SPEC: "fp16 scale underflow"). There cquant forms s * b in fp32 and rounds it to fp16 once. With an
# ordinary global scale kitchen's arithmetic is kept (SPEC §3: dequantize matches kitchen exactly).
FP16_TINY = 2.0 ** -14
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def nvfp4_fp16_tiny(sd: dict, prefix: str) -> bool:
    return float(sd[prefix + "weight_scale_2"]) < FP16_TINY


def nvfp4_fp16_rule(sd: dict, prefix: str, shape) -> torch.Tensor:
    "Independent decode with the block multiplier fp16(s * b) formed in fp32: e2m1(code) * fp16(s*b), in fp16."
    q = sd[prefix + "weight"].view(torch.uint8)
    Np, Kp = q.shape[0], 2 * q.shape[1]
    codes = torch.stack([q >> 4, q & 15], -1).reshape(Np, Kp).long()          # hi-first nibbles
    b = ck.from_blocked(sd[prefix + "weight_scale"].view(torch.float8_e4m3fn), Np, Kp // 16)
    mult = (sd[prefix + "weight_scale_2"].float() * b.float()).to(torch.float16)
    out = E2M1[codes].to(torch.float16).view(Np, Kp // 16, 16) * mult.unsqueeze(-1)
    return out.view(Np, Kp)[:shape[0], :shape[1]]


def fp8_fp16_tiny(sd: dict, prefix: str) -> bool:
    "fp8 decoded to fp16: kitchen computes q * fp16(scale); below fp16's normal range fp16(scale) keeps few bits."
    return float(sd[prefix + "weight_scale"]) < FP16_TINY


def kitchen_reference(v: Variant, sd: dict, prefix: str, shape, out) -> torch.Tensor:
    """What cquant must decode `sd` to in dtype `out`: kitchen's decode, except fp16 output with a scale below fp16's
    normal range: nvfp4 forms s*b in fp32 (`nvfp4_fp16_rule`), fp8 multiplies in fp32 and rounds once."""
    if out == torch.float16 and v.fmt == "nvfp4" and nvfp4_fp16_tiny(sd, prefix): return nvfp4_fp16_rule(sd, prefix, shape)
    if out == torch.float16 and v.fmt in ("float8_e4m3fn", "float8_e5m2") and fp8_fp16_tiny(sd, prefix):
        return kitchen_load(sd, prefix, shape, torch.float32).dequantize().to(torch.float16)
    return kitchen_load(sd, prefix, shape, out).dequantize()


# ----------------------------------------------------------------------------------------------------------------
# The harness itself: kitchen_load (ComfyUI's loader semantics) rebuilds kitchen's own tensors exactly
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
def test_harness_kitchen_load(v, dtype):
    shape = (33, 256) if v.convrot else (33, 50)
    w = make_weight(shape, dtype, "wide")
    k = kitchen_quantize(v, w)
    assert_bits(kitchen_load(kitchen_file(v, w), "m.", shape, dtype).dequantize(), k.dequantize(), f"harness {v.id}")


# ----------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------
def test_all_expected_formats_registered():
    missing = [f for f in EXPECTED_FORMATS if f not in cq.FORMATS]
    assert not missing, f"not registered: {missing}; cq.FORMATS = {sorted(cq.FORMATS)}"


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.id)
def test_storage_dtype_and_keys(v):
    spec = need(v.fmt)
    w = make_weight((33, 256) if v.convrot else (33, 50), torch.bfloat16)
    k = kitchen_quantize(v, w).state_dict("weight")
    assert spec.storage.dtype == k["weight"].dtype or (k["weight"].dtype == torch.uint8 and spec.storage.dtype.itemsize == 1)
    assert set(spec.storage.keys) <= set(k) - {"weight"} and set(k) <= set(spec.weight_keys), (spec.weight_keys, sorted(k))
    qt = cq.quantize(w, v.fmt, **v.opts)
    cfg = qt.config
    assert cfg["format"] == v.fmt
    assert bool(cfg.get("convrot", False)) == v.convrot, cfg
    if v.convrot: assert cfg["convrot_groupsize"] == v.opts["convrot_groupsize"], cfg


# ----------------------------------------------------------------------------------------------------------------
# 1. quantize: cquant writes kitchen's bytes
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v,shape,dtype,kind", cases(VARIANTS))
def test_quantize_bytes_equal_kitchen(v, shape, dtype, kind):
    need(v.fmt)
    w = make_weight(shape, dtype, kind)
    ours = cq.quantize(w, v.fmt, **v.opts)
    assert tuple(ours.shape) == tuple(shape) and ours.dtype == dtype
    compare_entries(ours.state_dict(""), expected_entries(v, w), f"quantize {v.id} {DT[dtype]} {shape} {kind}")


# ----------------------------------------------------------------------------------------------------------------
# 2. dequantize kitchen's tensors (through load_quantized) exactly as kitchen does, in every output dtype
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v,shape,dtype,kind", cases(VARIANTS, kinds=("wide",)))
def test_dequantize_kitchen_tensors(v, shape, dtype, kind):
    need(v.fmt)
    sd = kitchen_file(v, make_weight(shape, dtype, kind), "blocks.0.proj.")
    bad = []
    for out in DTYPES:
        ours = cq.load_quantized(sd, "blocks.0.proj.", shape=shape, dtype=out)
        assert ours.format == v.fmt and tuple(ours.shape) == tuple(shape) and ours.dtype == out
        theirs = kitchen_reference(v, sd, "blocks.0.proj.", shape, out)
        dq = ours.dequantize()
        if not same_bits(dq, theirs): bad.append(f"out {DT[out]}: {first_diff(dq, theirs)}")
    assert not bad, f"dequantize kitchen {v.id} (quantized from {DT[dtype]} {shape} {kind}): " + "; ".join(bad)


@pytest.mark.parametrize("v", [VBYID["nvfp4"], VBYID["mxfp8"]], ids=lambda v: v.id)
@pytest.mark.parametrize("shape", [(33, 50), (129, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_load_uint8_block_scales(v, shape):
    "Legacy files store block scales (and nvfp4/mxfp8 data) as raw uint8: they are reinterpreted, not cast."
    need(v.fmt)
    sd = kitchen_file(v, make_weight(shape, torch.bfloat16, "wide"))
    u8 = {k: (t.view(torch.uint8) if k.endswith("weight_scale") else t) for k, t in sd.items()}
    assert u8["m.weight_scale"].dtype == torch.uint8
    ours = cq.load_quantized(u8, "m.", shape=shape, dtype=torch.bfloat16).dequantize()
    assert_bits(ours, kitchen_load(sd, "m.", shape, torch.bfloat16).dequantize(), f"{v.id} uint8 scales")
    assert_bits(ours, cq.load_quantized(sd, "m.", shape=shape, dtype=torch.bfloat16).dequantize(), "uint8 vs native")


@pytest.mark.parametrize("v", INT8_VARIANTS[2:], ids=lambda v: v.id)
def test_load_nested_params_convrot(v):
    "ComfyUI precedence: rotation options nested in `params` are honoured, top-level keys win."
    need(v.fmt)
    shape = (33, 256)
    sd = kitchen_file(v, make_weight(shape, torch.float32))
    ref = kitchen_load(sd, "m.", shape, torch.float32).dequantize()
    g = v.opts["convrot_groupsize"]
    nested = {**sd, "m.comfy_quant": cq.encode_json({"format": v.fmt, "params": {"convrot": True, "convrot_groupsize": g}})}
    assert_bits(cq.load_quantized(nested, "m.", shape=shape, dtype=torch.float32).dequantize(), ref, "nested params")
    top = {**sd, "m.comfy_quant": cq.encode_json({"format": v.fmt, "convrot": True, "convrot_groupsize": g,
                                                  "params": {"convrot": False, "convrot_groupsize": 4}})}
    assert_bits(cq.load_quantized(top, "m.", shape=shape, dtype=torch.float32).dequantize(), ref, "top-level wins")


# ----------------------------------------------------------------------------------------------------------------
# 3. cquant's files dequantize in kitchen to the values cquant reports
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v,shape,dtype,kind", cases(VARIANTS, kinds=("gauss",)))
def test_cquant_file_in_kitchen(v, shape, dtype, kind):
    need(v.fmt)
    qt = cq.quantize(make_weight(shape, dtype, kind), v.fmt, **v.opts)
    sd = {**qt.state_dict("m."), "m.comfy_quant": cq.encode_json(qt.config)}
    bad = []
    for out in DTYPES:
        theirs = kitchen_reference(v, sd, "m.", shape, out)
        ours = qt.dequantize(out)
        if not same_bits(ours, theirs): bad.append(f"out {DT[out]}: {first_diff(ours, theirs)}")
        back = cq.load_quantized(sd, "m.", shape=shape, dtype=out).dequantize()
        if not same_bits(back, ours): bad.append(f"reload out {DT[out]}: {first_diff(back, ours)}")
    assert not bad, f"cquant file {v.id} {DT[dtype]} {shape} in kitchen: " + "; ".join(bad)


# ----------------------------------------------------------------------------------------------------------------
# 4. linears: fp8 (activation quantized the ComfyUI way) and int8 (dynamic per-token inside the kernel)
# ----------------------------------------------------------------------------------------------------------------
LIN_SHAPES = [((1,), 48, 64), ((5,), 48, 256), ((2, 3), 17, 256)]   # (batch dims, N, K)


def kitchen_fp8_linear(x, wk: KQT, bias, f8, input_scale=None):
    "ComfyUI's MixedPrecisionOps path: x flattened to 2-D, quantized with input_scale (1.0 if none), F.linear."
    x2 = x.reshape(-1, x.shape[-1])
    xq = KQT.from_float(x2, "TensorCoreFP8Layout", scale=1.0 if input_scale is None else input_scale, dtype=f8)
    return F.linear(xq, wk, bias).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("v", FP8_VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("lead,N,K", LIN_SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp8_linear_equals_kitchen(v, dtype, lead, N, K, bias):
    need(v.fmt)
    w = make_weight((N, K), dtype, "gauss", 1)
    x = (make_weight((*lead, K), torch.float32, "gauss", 2) * 4).to(dtype)
    b = make_weight((N,), dtype, "gauss", 3) if bias else None
    sd = kitchen_file(v, w)
    wk = kitchen_load(sd, "m.", (N, K), dtype)
    ours_w = cq.load_quantized(sd, "m.", shape=(N, K), dtype=dtype)
    assert_bits(F.linear(x, ours_w, b), kitchen_fp8_linear(x, wk, b, v.k_kw["dtype"]), f"F.linear {v.id} {DT[dtype]}")
    s = torch.tensor(0.03125, dtype=torch.float32)   # calibrated input_scale
    ours = ours_w.layout.linear(x, ours_w.qdata, ours_w.params, b, input_scale=s)
    assert_bits(ours, kitchen_fp8_linear(x, wk, b, v.k_kw["dtype"], s), f"linear input_scale {v.id} {DT[dtype]}")


@pytest.mark.parametrize("v,lead,N,K", [pytest.param(v, *s, id=f"{v.id}-{s}") for v in INT8_VARIANTS
                                          for s in LIN_SHAPES if s[2] % v.group == 0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int8_linear_equals_kitchen(v, dtype, lead, N, K, bias):
    need(v.fmt)
    w = make_weight((N, K), dtype, "wide", 1)
    x = make_weight((*lead, K), dtype, "gauss", 2)
    b = make_weight((N,), dtype, "gauss", 3) if bias else None
    sd = kitchen_file(v, w)
    wk = kitchen_load(sd, "m.", (N, K), dtype)
    ours = F.linear(x, cq.load_quantized(sd, "m.", shape=(N, K), dtype=dtype), b)
    assert_bits(ours, F.linear(x, wk, b), f"F.linear {v.id} {DT[dtype]} x{tuple(x.shape)}")
    direct = ck.int8_linear(x, sd["m.weight"], sd["m.weight_scale"], b, dtype, convrot=v.convrot,
                            convrot_groupsize=v.opts.get("convrot_groupsize", 256))
    assert_bits(ours, direct, "vs ck.int8_linear")


# ----------------------------------------------------------------------------------------------------------------
# 5. Deliberate differences from kitchen
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
def test_all_zero_weight(v, dtype):
    """kitchen's fp8 and nvfp4 default scale is 0 for an all-zero weight, so it decodes to all-NaN; cquant
    decodes exact zeros, and its file decodes to zeros in kitchen too. Other formats: identical bytes."""
    need(v.fmt)
    shape = (32, 256) if v.convrot else (33, 50)
    w = torch.zeros(shape, dtype=dtype)
    ours = cq.quantize(w, v.fmt, **v.opts)
    dq = ours.dequantize()
    assert dq.dtype == dtype and bool((dq == 0).all()), f"{v.id}: cquant zero weight decodes to {dq.unique()}"
    k = kitchen_quantize(v, w)
    if v.fmt in ("float8_e4m3fn", "float8_e5m2", "nvfp4"):
        assert bool(k.dequantize().isnan().all()), "kitchen's known zero-weight NaN changed: update this test"
        assert not same_bits(ours.state_dict("")["weight"], k.state_dict("weight")["weight"])
    else:
        compare_entries(ours.state_dict(""), k.state_dict("weight"), f"zero weight {v.id}")
    sd = {**ours.state_dict("m."), "m.comfy_quant": cq.encode_json(ours.config)}
    kd = kitchen_load(sd, "m.", shape, dtype).dequantize()
    assert bool((kd == 0).all()), f"kitchen decodes cquant's zero {v.id} file to {kd.unique()}"


def kitchen_fp8_overflows(v: Variant, w: torch.Tensor) -> bool:
    "kitchen's fp8 encoder multiplies by (1/scale) rounded to w's dtype: in fp16 that overflows to inf for small weights."
    if v.fmt not in ("float8_e4m3fn", "float8_e5m2"): return False
    s = (w.abs().amax() / torch.finfo(v.k_kw["dtype"]).max).float()
    return not bool(torch.isfinite((1.0 / s).to(w.dtype)))


def fp8_fixed_entries(v: Variant, w: torch.Tensor) -> dict:
    "cquant's rule where kitchen's fp16 reciprocal overflows: scale = amax / fp8 max in fp32, elements w.float() / scale."
    f8 = v.k_kw["dtype"]; m = torch.finfo(f8).max
    s = w.abs().amax().float() / m
    if float(s) == 0: s = torch.ones((), dtype=torch.float32)
    return {"weight": (w.float() / s).clamp(-m, m).to(f8), "weight_scale": s}


def expected_entries(v: Variant, w: torch.Tensor) -> dict:
    """The file entries cquant must write for `w`: kitchen's, except where kitchen's encoder breaks on small fp16 weights
    (fp8: 1/scale overflows fp16; nvfp4: the global scale flushes to 0)."""
    if kitchen_fp8_overflows(v, w): return fp8_fixed_entries(v, w)
    amax = w.abs().amax()
    if v.fmt == "nvfp4" and float(amax / 2688) == 0 and float(amax) != 0:
        return KQT.from_float(w, "TensorCoreNVFP4Layout", scale=amax.float() / 2688).state_dict("weight")
    entries = kitchen_quantize(v, w).state_dict("weight")
    if v.fmt == "int8_tensorwise" and w.dtype == torch.float16: entries = int8_fp16_subnormal_rows(v, w, entries)
    return entries


def int8_fp16_subnormal_rows(v: Variant, w: torch.Tensor, entries: dict) -> dict:
    """fp16 int8 weights: kitchen divides by fp16(scale), a subnormal for scales below 2**-14; cquant divides those rows
    in fp32 by the same stored scale. Expected = kitchen's bytes, those rows from kitchen's fp32 quantizer of the same
    (for ConvRot: kitchen-rotated, in fp16) values."""
    small = (entries["weight_scale"].float() < 2.0 ** -14).reshape(-1)
    if not small.any(): return entries
    src = w
    if v.convrot:
        g = v.opts["convrot_groupsize"]
        src = _rotate_weight(w, _build_hadamard(g, dtype=w.dtype, device=w.device), g)
    per_row = v.convrot or v.opts.get("per_row", False)
    q32 = KQT.from_float(src.float(), "TensorWiseINT8Layout", per_channel=per_row).state_dict("weight")["weight"]
    q = entries["weight"].clone()
    rows = small.expand(q.shape[0]) if small.numel() == 1 else small
    q[rows] = q32[rows]
    return {**entries, "weight": q}


@pytest.mark.parametrize("v", FP8_VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("mag", [1e-6, 1e-3, 0.1])
def test_fp8_fp16_small_weights(v, mag):
    """kitchen computes fp16 weights' fp8 codes as w * fp16(1/scale): for max|w| below fp8max/65504 (e4m3: 0.0068,
    e5m2: 0.875) the reciprocal overflows and every element saturates (or becomes NaN where the scale underflows).
    cquant then divides in fp32 instead: the scale is max|w| / fp8max in fp32 and the codes are exact."""
    need(v.fmt)
    w = (make_weight((33, 50), torch.float32, "gauss") * mag).to(torch.float16)
    assert kitchen_fp8_overflows(v, w) == (mag < 0.1 or v.fmt == "float8_e5m2")
    ours = cq.quantize(w, v.fmt)
    if not kitchen_fp8_overflows(v, w):
        compare_entries(ours.state_dict(""), kitchen_quantize(v, w).state_dict("weight"), f"{v.id} fp16 x{mag}")
        return
    compare_entries(ours.state_dict(""), fp8_fixed_entries(v, w), f"{v.id} fp16 x{mag} (fp32 division)")
    k = kitchen_quantize(v, w).dequantize(); kq = float(cq.numerics.sqnr(w, k.float()))
    assert math.isnan(kq) or kq < 5, f"kitchen's fp16 overflow is fixed (SQNR {kq}): update this test"
    floor = 25 if v.fmt == "float8_e4m3fn" else 19
    assert cq.numerics.sqnr(w, ours.dequantize(torch.float32)) > floor
    sd = {**ours.state_dict("m."), "m.comfy_quant": cq.encode_json(ours.config)}
    assert_bits(kitchen_load(sd, "m.", (33, 50), torch.float32).dequantize(), ours.dequantize(torch.float32), "file in kitchen")


@pytest.mark.parametrize("mag", [1e-6, 1e-5, 1e-3])
def test_nvfp4_fp16_tiny_weights(mag):
    """kitchen computes nvfp4's global scale max|w| / 2688 in the weight's dtype: for fp16 weights with max|w| below
    ~1.6e-4 it flushes to 0 and the whole weight encodes as zeros. cquant then computes it in fp32 (kitchen's encoder
    with that explicit scale gives the same bytes); otherwise it is kitchen's scale."""
    need("nvfp4")
    v, shape = VBYID["nvfp4"], (33, 50)
    w = (make_weight(shape, torch.float32, "gauss") * mag).to(torch.float16)
    amax = w.abs().amax()
    flushes = float(amax / 2688) == 0
    assert flushes == (mag < 1e-3)
    ours = cq.quantize(w, "nvfp4")
    if not flushes:
        compare_entries(ours.state_dict(""), kitchen_quantize(v, w).state_dict("weight"), f"nvfp4 fp16 x{mag}")
        return
    fixed = KQT.from_float(w, "TensorCoreNVFP4Layout", scale=amax.float() / 2688)
    compare_entries(ours.state_dict(""), fixed.state_dict("weight"), f"nvfp4 fp16 x{mag} (fp32 global scale)")
    assert bool((kitchen_quantize(v, w).dequantize() == 0).all()), "kitchen's fp16 scale flush is fixed: update this test"
    assert cq.numerics.sqnr(w, ours.dequantize(torch.float32)) > 15
    sd = {**ours.state_dict("m."), "m.comfy_quant": cq.encode_json(ours.config)}
    assert_bits(kitchen_load(sd, "m.", shape, torch.float32).dequantize(), ours.dequantize(torch.float32), "file in kitchen")


@pytest.mark.parametrize("v", FP8_VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("mag", [1e-3, 0.05, 100.0])
def test_fp8_fp16_decode(v, mag):
    """fp8 decoded to fp16: kitchen multiplies q by fp16(scale). With a scale below 2^-14 (e4m3: max|w| < 0.027,
    e5m2: max|w| < 3.5, so most e5m2 weights) fp16(scale) is subnormal and loses bits (at max|w| ~4e-3 an e5m2 scale of
    7e-8 becomes one subnormal step, 6e-8). cquant multiplies in fp32 and rounds once; otherwise it is kitchen's product."""
    need(v.fmt)
    shape = (64, 256)
    sd = kitchen_file(v, make_weight(shape, torch.float32, "gauss") * mag)
    k16 = kitchen_load(sd, "m.", shape, torch.float16).dequantize()
    exact = kitchen_load(sd, "m.", shape, torch.float32).dequantize()
    ours = cq.load_quantized(sd, "m.", shape=shape, dtype=torch.float16).dequantize()
    if not fp8_fp16_tiny(sd, "m."):
        assert mag == 100.0 or (mag == 0.05 and v.fmt == "float8_e4m3fn")
        assert_bits(ours, k16, f"{v.id} fp16 decode, ordinary scale: kitchen's arithmetic")
        return
    assert_bits(ours, exact.to(torch.float16), f"{v.id} fp16 decode, tiny scale: fp32 product rounded once")
    sq = lambda a: cq.numerics.sqnr(exact, a.float())
    assert sq(ours) >= sq(k16), (sq(ours), sq(k16))
    if mag == 1e-3: assert sq(k16) < sq(ours) - 3, f"kitchen's fp16 underflow is fixed ({sq(k16)} dB): update this test"


@pytest.mark.parametrize("mag", [1e-3, 1e-2, 1.0])
def test_nvfp4_fp16_decode(mag):
    """nvfp4 decoded to fp16: with a tiny global scale (max|w| ~ 1e-3 or 1e-2 gives s = max|w|/2688 below 2^-14)
    kitchen loses up to ~1%, cquant forms s*b in fp32 (independent reference `nvfp4_fp16_rule`) and stays within fp16
    rounding of the exact value; with an ordinary global scale (max|w| ~ 4) cquant equals kitchen bit for bit."""
    need("nvfp4")
    shape = (64, 256)
    sd = kitchen_file(VBYID["nvfp4"], make_weight(shape, torch.float32, "gauss") * mag)
    k16 = kitchen_load(sd, "m.", shape, torch.float16).dequantize()
    exact = kitchen_load(sd, "m.", shape, torch.float32).dequantize()
    ours = cq.load_quantized(sd, "m.", shape=shape, dtype=torch.float16).dequantize()
    rel = lambda a: ((a.float() - exact).norm() / exact.norm()).item()
    if not nvfp4_fp16_tiny(sd, "m."):
        assert mag == 1.0
        assert_bits(ours, k16, "nvfp4 fp16 decode, ordinary global scale: kitchen's arithmetic")
        return
    if mag == 1e-3: assert rel(k16) > 2e-3, f"kitchen's fp16 underflow is fixed (rel {rel(k16)}): update this test"
    assert_bits(ours, nvfp4_fp16_rule(sd, "m.", shape), "nvfp4 fp16 decode, tiny global scale: fp32 s*b")
    assert rel(ours) < 5e-4 and rel(ours) < rel(k16), (rel(ours), rel(k16))


# ----------------------------------------------------------------------------------------------------------------
# 6. Full-size case (slow)
# ----------------------------------------------------------------------------------------------------------------
def _slow_requested(config) -> bool:
    return "slow" in (config.getoption("markexpr", "") or "") or os.environ.get("CQUANT_SLOW", "") not in ("", "0")


@pytest.mark.slow
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
def test_4096_square(v, dtype, request):
    if not _slow_requested(request.config): pytest.skip("4096x4096: run with -m slow or CQUANT_SLOW=1")
    need(v.fmt)
    w = make_weight((4096, 4096), dtype, "gauss")
    ours = cq.quantize(w, v.fmt, **v.opts)
    k = kitchen_quantize(v, w)
    compare_entries(ours.state_dict(""), k.state_dict("weight"), f"4096 {v.id} {DT[dtype]}")
    assert_bits(ours.dequantize(), k.dequantize(), f"4096 dequantize {v.id} {DT[dtype]}")


# ----------------------------------------------------------------------------------------------------------------
# 5. rounding='mse' / 'gptq' / 'exact' (cquant.rounding) write the same formats: kitchen decodes them to cquant's values
# ----------------------------------------------------------------------------------------------------------------
ROUNDED = [v for v in VARIANTS if cq.get_format(v.fmt).declares('grid')]


def _rounding_kw(rounding, K, seed=3):
    if rounding in ("mse", "exact"): return dict(rounding=rounding)
    x = torch.randn(96, K, generator=torch.Generator().manual_seed(seed))
    return dict(rounding="gptq", calibration=x)


@pytest.mark.parametrize("rounding", ("mse", "gptq", "exact"))
@pytest.mark.parametrize("v", ROUNDED, ids=lambda v: v.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
def test_rounded_file_in_kitchen(v, dtype, rounding):
    shape = v.shapes()[-1]
    w = make_weight(shape, dtype, "wide")
    qt = cq.quantize(w, v.fmt, **v.opts, **_rounding_kw(rounding, shape[1]))
    ref = cq.quantize(w, v.fmt, **v.opts)
    sd = {**qt.state_dict("m."), "m.comfy_quant": cq.encode_json(qt.config)}
    test_kw = {k: (t.dtype, tuple(t.shape)) for k, t in ref.state_dict("m.").items()}
    assert {k: (t.dtype, tuple(t.shape)) for k, t in qt.state_dict("m.").items()} == test_kw
    bad = []
    for out in DTYPES:
        theirs, ours = kitchen_reference(v, sd, "m.", shape, out), qt.dequantize(out)
        if not same_bits(ours, theirs): bad.append(f"out {DT[out]}: {first_diff(ours, theirs)}")
    assert not bad, f"{rounding} {v.id} {DT[dtype]} {shape} in kitchen: " + "; ".join(bad)


@pytest.mark.parametrize("rounding", ("mse", "gptq", "exact"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
def test_rounded_w4a4_in_kitchen(dtype, rounding):
    N, K, G = 48, 512, 64
    w = make_weight((N, K), dtype, "wide")
    qt = cq.quantize(w, "convrot_w4a4", convrot_groupsize=G, **_rounding_kw(rounding, K))
    q, s = qt.state_dict("")["weight"], qt.state_dict("")["weight_scale"]
    for out in DTYPES:
        assert_bits(qt.dequantize(out), ck.dequantize_convrot_w4a4_weight(q, s, G, 64, out), f"{rounding} {DT[dtype]}->{DT[out]}")
