"""awq_w4a16 (nbs/07a_awq.ipynb): bit-exact decoding and linear against comfy-kitchen 0.2.40's
`TensorCoreAWQW4A16Layout` / eager `gemv_awq_w4a16` over random shapes, group sizes, dtypes and seeds; the encoders'
guarantees (never worse than min/max per group; calibrated never worse than min/max on its calibration inputs, and
better on held-out inputs); the file round trip through the module layer; and the errors bad inputs and files get."""
from __future__ import annotations
import math, tempfile
from pathlib import Path
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import cquant as cq
from cquant.awq import AWQ_ALPHAS
from cquant.tensor import same_bits, test_bits as assert_bits

ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (the bit-exactness oracle) is not installed")
from comfy_kitchen.tensor import QuantizedTensor as KQT, TensorCoreAWQW4A16Layout as KL  # noqa: E402
from comfy_kitchen.backends.eager.awq import gemv_awq_w4a16  # noqa: E402

FMT = "awq_w4a16"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def weight(shape, dtype, seed, exp10=0.0, outliers=0.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 10.0 ** exp10
    if outliers: w[torch.rand(shape, generator=g) < outliers] *= 10
    return w.to(dtype)


def kitchen_load(sd: dict, prefix: str, shape, dtype) -> KQT:
    "kitchen's QuantizedTensor from file entries as ComfyUI's loader builds it (group_size top-level, default 64)."
    cfg = cq.decode_json(sd[prefix + "comfy_quant"])
    p = KL.Params(scale=sd[prefix + "weight_scale"], zeros=sd[prefix + "weight_zeros"],
                  group_size=int(cfg.get("group_size", 64)), orig_dtype=dtype, orig_shape=tuple(shape))
    return KQT(sd[prefix + "weight"], "TensorCoreAWQW4A16Layout", p)


def file_of(qt, prefix="m."):
    return {**qt.state_dict(prefix), prefix + "comfy_quant": cq.encode_json(qt.config)}


groups = st.sampled_from([2, 4, 8, 16, 32, 64, 128])


@settings(max_examples=60, **COMMON)
@given(n=st.integers(1, 24), kmul=st.integers(1, 4), G=groups, dtype=st.sampled_from(DTYPES),
       out=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), exp10=st.floats(-4, 3),
       clip=st.booleans(), sr=st.sampled_from([0, 7]))
def test_decode_matches_kitchen(n, kmul, G, dtype, out, seed, exp10, clip, sr):
    "cquant's file, read by kitchen the ComfyUI way, decodes bit-identically to cquant in every output dtype."
    shape = (n, G * kmul)
    w = weight(shape, dtype, seed, exp10, outliers=0.02)
    qt = cq.quantize(w, FMT, group_size=G, clip_search=clip, stochastic_rounding=sr)
    sd = file_of(qt)
    kq = kitchen_load(sd, "m.", shape, out)
    assert_bits(qt.dequantize(out), kq.dequantize().to(out), f"{shape} G={G} {dtype}->{out}")
    ksd = kq.state_dict("m.weight")                 # kitchen writes back the same keys and bytes
    assert sorted(ksd) == sorted(k for k in sd if k != "m.comfy_quant") and all(same_bits(ksd[k], sd[k]) for k in ksd)
    back = cq.load_quantized(sd, "m.", dtype=out)
    assert_bits(back.dequantize(), qt.dequantize(out), "reload")
    s, z = sd["m.weight_scale"], sd["m.weight_zeros"]
    assert (s.dtype, z.dtype, tuple(s.shape), tuple(z.shape)) == (dtype, dtype, (shape[1] // G, n), (shape[1] // G, n))
    assert sd["m.weight"].dtype == torch.int8 and tuple(sd["m.weight"].shape) == (n, shape[1] // 2)


@settings(max_examples=40, **COMMON)
@given(n=st.integers(1, 24), kmul=st.integers(1, 3), G=groups, dtype=st.sampled_from(DTYPES),
       m=st.integers(1, 9), seed=st.integers(0, 2**31 - 1), bias=st.booleans(), lead3=st.booleans())
def test_linear_matches_kitchen_eager(n, kmul, G, dtype, m, seed, bias, lead3):
    """F.linear on cquant's tensor equals kitchen's eager gemv_awq_w4a16 and kitchen's own F.linear dispatch bit for
    bit (the same decode and the same GEMM on the same operands, whatever the BLAS blocking)."""
    K = G * kmul
    w = weight((n, K), dtype, seed)
    qt = cq.quantize(w, FMT, group_size=G)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn((2, m, K) if lead3 else (m, K), generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ours = F.linear(x, qt, b)
    p = qt.params
    assert_bits(ours, gemv_awq_w4a16(x, qt.qdata, p.scale, p.zeros, bias=b, group_size=G), "eager op")
    with ck.use_backend("eager"):
        assert_bits(ours, F.linear(x, kitchen_load(file_of(qt), "m.", (n, K), dtype), b), "kitchen dispatch")


@settings(max_examples=30, **COMMON)
@given(n=st.integers(1, 16), kmul=st.integers(1, 4), G=groups, dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1), weighted=st.booleans())
def test_clip_search_never_worse_than_minmax(n, kmul, G, dtype, seed, weighted):
    "Per group, the (weighted) squared error of the clip search + refit is at most plain min/max's (decoded in w's dtype)."
    K = G * kmul
    w = weight((n, K), dtype, seed, outliers=0.03)
    d = torch.rand(K, generator=torch.Generator().manual_seed(seed)) ** 3 if weighted else torch.ones(K)
    def err(**kw):
        e = (w.float() - cq.dequantize_awq(*cq.quantize_awq(w, G, d if weighted else None, **kw), G).float()).square()
        return (e * d).view(n, K // G, G).sum(-1)
    e0, e1 = err(clip_search=False), err()
    assert bool((e1 <= e0).all()), float((e1 - e0).max())


def test_clip_search_gains_on_gaussian():
    w = weight((128, 1024), torch.float32, 3)
    s0 = cq.sqnr(w, cq.quantize(w, FMT, clip_search=False).dequantize())
    s1 = cq.sqnr(w, cq.quantize(w, FMT).dequantize())
    assert 20.5 < s0 < 21.5 and s1 > s0 + 0.4, (s0, s1)


def test_constant_and_zero_groups_are_exact():
    w = torch.zeros(4, 128)
    w[1] = 0.75; w[2, :64] = -3.0; w[3, 64:] = 1e-30
    for dt in DTYPES:
        qt = cq.quantize(w.to(dt), FMT)
        assert same_bits(qt.dequantize(), w.to(dt)), dt
        assert float(qt.params.scale.float().abs().sum()) == 0.0


def outlier_inputs(m, K, seed, hot=(3, 17, 40, 101)):
    "Activations with a few large input features (as after a LayerNorm), calibration and held-out from one law."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    x[:, list(hot)] *= 12
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_calibrated_awq_beats_minmax(dtype):
    """Calibrated AWQ: never worse than min/max on its calibration inputs (min/max is one of its candidates), over
    1 dB better on held-out inputs of the same law, and chooses alpha > 0 when a few input features dominate."""
    w = weight((96, 256), dtype, 11)
    xc, xe = outlier_inputs(300, 256, 1), outlier_inputs(300, 256, 2)
    q, s, z, alpha, errs = cq.awq_search(w, xc)
    assert [a for a, _ in errs] == [None, *AWQ_ALPHAS] and alpha is not None and alpha > 0
    assert min(e for _, e in errs) == dict(errs)[alpha] <= dict(errs)[None]
    qt = cq.quantize(w, FMT, calibration=xc)
    assert same_bits(qt.qdata, q) and same_bits(qt.params.scale, s) and same_bits(qt.params.zeros, z)
    ref = xe @ w.float().t()
    out = lambda t: cq.sqnr(ref, xe @ t.dequantize(torch.float32).t())
    plain, free = cq.quantize(w, FMT, clip_search=False), cq.quantize(w, FMT)
    assert out(qt) > out(plain) + 1.0 and out(qt) > out(free), (out(plain), out(free), out(qt))


@settings(max_examples=15, **COMMON)
@given(n=st.integers(1, 12), kmul=st.integers(1, 3), G=st.sampled_from([4, 16, 64]), m=st.integers(1, 80),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_calibrated_search_properties(n, kmul, G, m, dtype, seed):
    """For any shape, dtype and number of calibration rows: the stored result is the candidate with the least output
    error on the calibration inputs (so never worse than min/max there), and that error is what the file decodes to."""
    K = G * kmul
    w = weight((n, K), dtype, seed, outliers=0.02)
    x = outlier_inputs(m, K, seed + 1, hot=(0, K - 1))
    q, s, z, alpha, errs = cq.awq_search(w, x, G)
    best = min(e for _, e in errs)
    assert dict(errs)[alpha] == best <= dict(errs)[None]
    dw = w.float() - cq.dequantize_awq(q, s, z, G).float()
    got = float((x @ dw.t()).square().sum())
    assert math.isclose(got, best, rel_tol=1e-3, abs_tol=1e-9 * float((x @ w.float().t()).square().sum())), (got, best)
    assert (s.dtype, z.dtype, tuple(s.shape)) == (dtype, dtype, (K // G, n)) and bool((s >= 0).all())


def test_calibrated_accepts_batched_inputs_and_is_deterministic():
    w = weight((32, 128), torch.float32, 5)
    x = outlier_inputs(60, 128, 3)
    a = cq.quantize(w, FMT, calibration=x)
    b = cq.quantize(w, FMT, calibration=x.view(3, 20, 128))
    assert same_bits(a.qdata, b.qdata) and same_bits(a.params.scale, b.params.scale)


def test_row_blocks_join_along_n():
    "Data-free rows are independent: row blocks quantize to the same bytes, the group tensors joined along dim 1."
    spec = cq.FORMATS[FMT]
    w = weight((40, 192), torch.bfloat16, 8, outliers=0.02)
    assert spec.rows_independent({}) and spec.storage.row_assembly == {"weight_scale": 1, "weight_zeros": 1}
    whole = cq.quantize(w, FMT).state_dict("")
    parts = [cq.quantize(w[i:i + 16], FMT).state_dict("") for i in range(0, 40, 16)]
    for k, t in whole.items():
        assert same_bits(t, torch.cat([p[k] for p in parts], spec.storage.row_assembly.get(k, 0))), k


def test_checkpoint_round_trip_through_modules(tmp_path):
    "A file cquant writes loads into a model (QuantLinear) through load_file and runs kitchen's linear."
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(4, 128)
    batches = [(torch.randn(8, 128),) for _ in range(3)]
    q = cq.quantize_model(model, {"0": FMT, "2": (FMT, {"group_size": 32})}, calibration=batches)
    sd = q.state_dict()
    assert cq.decode_json(sd["2.comfy_quant"]) == {"format": FMT, "group_size": 32}
    cq.save_file(sd, tmp_path / "awq.safetensors")
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    loaded = cq.load_quantized_model(fresh, cq.load_file(tmp_path / "awq.safetensors"))
    assert_bits(loaded(x), q(x), "loaded model")
    h = F.gelu(gemv_awq_w4a16(x, sd["0.weight"], sd["0.weight_scale"], sd["0.weight_zeros"], sd["0.bias"], 64))
    assert_bits(loaded(x), gemv_awq_w4a16(h, sd["2.weight"], sd["2.weight_scale"], sd["2.weight_zeros"], sd["2.bias"], 32))


def test_quantize_model_uses_the_calibration():
    "quantize_model gives each layer its inputs: the calibrated bytes equal cq.quantize(..., calibration=inputs)."
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(128, 48))
    batches = [(outlier_inputs(40, 128, s),) for s in range(3)]
    x = cq.collect_inputs(model, batches)["0"]
    want = cq.quantize(model[0].weight.detach(), FMT, calibration=x)
    q = cq.quantize_model(model, {"0": FMT}, calibration=batches)
    assert same_bits(q[0].weight.qdata, want.qdata) and same_bits(q[0].weight.params.zeros, want.params.zeros)


# ---- bad input ---------------------------------------------------------------------------------------------------
def test_shape_and_option_errors():
    with pytest.raises(cq.QuantFormatError, match=r"'blk\.fc\.comfy_quant\['group_size'\]': expected an even group size G >= 2 that divides K=100 of weight shape \(8, 100\), found G=64 \(K % G = 36\)"):
        cq.quantize(torch.randn(8, 100), FMT, name="blk.fc.weight")
    with pytest.raises(cq.QuantFormatError, match=r"found G=5"):
        cq.quantize(torch.randn(8, 100), FMT, group_size=5)
    with pytest.raises(cq.QuantFormatError, match=r"found G=0"):
        cq.quantize(torch.randn(8, 64), FMT, group_size=0)
    with pytest.raises(cq.QuantFormatError, match=r"'blk\.fc\.weight': expected a non-empty 2-D"):
        cq.quantize(torch.randn(2, 8, 64), FMT, name="blk.fc.weight")
    with pytest.raises(ValueError, match="group_size"):
        cq.quantize(torch.randn(8, 64), FMT, group_size="64")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_weights_and_activations(bad):
    w = torch.randn(16, 128)
    w[3, 7] = bad
    with pytest.raises(ValueError, match=r"enc\.fc\.weight: 1 non-finite value\(s\) \(first at index \(3, 7\)"):
        cq.quantize(w, FMT, name="enc.fc.weight")
    with pytest.raises(cq.QuantFormatError, match=r"weight_scale'?: expected finite and >= 0.*refusing to write"):
        cq.quantize(w, FMT, allow_nonfinite=True)
    x = torch.randn(10, 128)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=r"calibration for enc\.fc\.weight: 1 non-finite value\(s\) \(first at index \(2, 5\)"):
        cq.quantize(torch.randn(16, 128), FMT, calibration=x, name="enc.fc.weight")


def test_calibration_shape_errors():
    w = torch.randn(16, 128)
    for x, found in ((torch.randn(10, 64), r"torch\.float32 tensor of shape \(10, 64\)"),
                     (torch.zeros(0, 128), r"torch\.float32 tensor of shape \(0, 128\)"),
                     (torch.ones(10, 128, dtype=torch.int32), r"torch\.int32"), ([[1.0] * 128], "list")):
        with pytest.raises(cq.QuantFormatError, match=r"'calibration for enc\.fc\.weight': expected float inputs "
                           r"\[\.\.\., 128\] \(the in_features of weight \(16, 128\)\), found " + found):
            cq.quantize(w, FMT, calibration=x, name="enc.fc.weight")


def test_bad_files_name_the_key():
    qt = cq.quantize(torch.randn(16, 128), FMT)
    sd = file_of(qt, "blk.")
    cases = [
        ({"blk.weight_scale": sd["blk.weight_scale"].t().contiguous()}, r"'blk\.weight_scale': expected a float32, bfloat16 or float16 tensor of shape \(2, 16\)"),
        ({"blk.weight_zeros": sd["blk.weight_zeros"].to(torch.bfloat16)}, r"'blk\.weight_zeros': expected the dtype of weight_scale"),
        ({"blk.weight_zeros": torch.full((2, 16), math.nan)}, r"'blk\.weight_zeros': expected finite zero points"),
        ({"blk.weight_scale": -sd["blk.weight_scale"]}, r"'blk\.weight_scale': expected finite and >= 0"),
        ({"blk.weight_scale": sd["blk.weight_scale"].to(torch.int32)}, r"'blk\.weight_scale': expected a float32"),
        ({"blk.comfy_quant": cq.encode_json({"format": FMT, "group_size": 32})}, r"'blk\.weight_scale': expected .* shape \(4, 16\) \(K/G, N\), found torch\.float32 of shape \(2, 16\) \(the groups of G=64: is the top-level comfy_quant\['group_size'\]=32 right\?\)"),
        ({"blk.comfy_quant": cq.encode_json({"format": FMT, "group_size": 3})}, r"comfy_quant\['group_size'\]': expected an even group size"),
        ({"blk.weight": sd["blk.weight"][:, :32]}, r"'blk\.comfy_quant\['group_size'\]'|'blk\.weight_scale'"),
    ]
    for patch, msg in cases:
        with pytest.raises(cq.QuantFormatError, match=msg): cq.load_quantized({**sd, **patch}, "blk")
    missing = {k: v for k, v in sd.items() if k != "blk.weight_zeros"}
    with pytest.raises(cq.QuantFormatError, match=r"'blk\.weight_zeros': expected awq_w4a16 tensors"):
        cq.load_quantized(missing, "blk")


def test_declared_facts():
    spec = cq.FORMATS[FMT]
    assert (spec.storage.keys, spec.storage.dtype, spec.storage.group_size, spec.loader.quantize_input) == (("weight_scale", "weight_zeros"), torch.int8, 64, False)
    assert spec.kitchen_layout == "TensorCoreAWQW4A16Layout" and spec.layout.MIN_SM_VERSION == KL.MIN_SM_VERSION
    assert spec.declares('calibrated') and spec.native_on("cpu") and spec.native_on("xpu")
    assert spec.config(spec.resolve(None)) == {"format": FMT, "group_size": 64}
    assert spec.resolve({"format": FMT, "params": {"group_size": 32}})["group_size"] == 64     # top level only
    assert spec.resolve({"format": FMT, "group_size": 32, "params": {"group_size": 16}})["group_size"] == 32
