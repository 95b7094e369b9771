"""svdquant_w4a4 against comfy-kitchen 0.2.40's `TensorCoreSVDQuantW4A4Layout` and its eager ops (the reference).

- the activation quantization (codes, packing, scales) is kitchen's bit for bit, signed and unsigned, every dtype;
- the decode is kitchen's `dequantize` bit for bit where no float GEMM enters (a zero low-rank branch) and within the
  bound of the fp32 GEMM's blocking otherwise; the same for the linear (two float GEMMs: a bound, never bits);
- tile-packed storage (`kitchen_tile_packed_w4a4`) is what kitchen unpacks, and decodes as the natural storage does;
- files round-trip through `cq.save_file` / `cq.load_file`, `load_quantized`, `QuantLinear` and kitchen;
- the encoder: full rank leaves no residual, calibration beats the data-free variant on outlier channels;
- bad shapes, ranks, files and calibration inputs get errors naming the module, the option and the shape.
"""
from __future__ import annotations
import warnings
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import cquant as cq
from cquant import svdquant as S
from cquant.checkpoint import inspect_checkpoint, format_inspect
from cquant.tensor import same_bits, test_bits as assert_bits   # alias: pytest would collect test_bits

ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen 0.2.40 (the oracle) is not installed")
from comfy_kitchen.tensor import TensorCoreSVDQuantW4A4Layout as KL, QuantizedTensor as KQT  # noqa: E402
from comfy_kitchen.backends.eager import svdquant as KE  # noqa: E402

FMT = "svdquant_w4a4"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
dtypes, seeds = st.sampled_from(DTYPES), st.integers(0, 2**31 - 1)


def storage(N, K, R, dtype, seed, zero_branch=False):
    "Random stored tensors of an N x K layer with rank R (any int4 bit pattern, positive scales and smoothing)."
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(N, R, generator=g).mul(0.1).to(dtype)
    return dict(weight=torch.randint(-128, 128, (N, K // 2), dtype=torch.int8, generator=g),
                weight_scale=torch.rand(K // 64, N, generator=g).add(0.01).mul(0.05).to(dtype),
                weight_proj_down=torch.randn(K, R, generator=g).mul(0.1).to(dtype),
                weight_proj_up=torch.zeros_like(up) if zero_branch else up,
                weight_smooth_factor=torch.rand(K, generator=g).mul(4).add(0.1).to(dtype))


def ours(t, N, K, dtype, config=None):
    "cquant's QuantizedTensor from file entries `t` (module prefix 'm.')."
    sd = {f"m.{k}": v for k, v in t.items()}
    sd["m.comfy_quant"] = cq.encode_json(config or {"format": FMT})
    return cq.load_quantized(sd, "m.", shape=(N, K), dtype=dtype)


def kitchen(t, N, K, dtype, act_unsigned=False):
    "kitchen's QuantizedTensor from the same entries, as the ComfyUI pull request's loader builds it."
    p = KL.Params(scale=t["weight_scale"], orig_dtype=dtype, orig_shape=(N, K), proj_down=t["weight_proj_down"],
                  proj_up=t["weight_proj_up"], smooth_factor=t["weight_smooth_factor"], act_unsigned=act_unsigned)
    return KQT(t["weight"], "TensorCoreSVDQuantW4A4Layout", p)


def branch_bound(t, dtype, out, R):
    """Two roundings of `dtype` at the output, R fp32 accumulation errors of the branch's size, and one rounding of
    `dtype` at the branch's size: the branch is cast to `dtype` before the residual is added, so GEMMs blocked apart
    by an fp32 ulp can round it to neighbouring values (nkr=(11, 64, 11), fp16, seed 3324: one ulp of a 0.03 branch)."""
    mag = t["weight_proj_up"].float().abs() @ t["weight_proj_down"].float().abs().t()
    return 2 * torch.finfo(dtype).eps * out.float().abs() + (R * 2.0 ** -23 + torch.finfo(dtype).eps) * mag


shapes = st.tuples(st.integers(1, 48), st.integers(1, 5).map(lambda k: 64 * k), st.integers(1, 16))


@settings(max_examples=25, **COMMON)
@given(mk=st.tuples(st.integers(1, 40), st.integers(1, 5).map(lambda k: 64 * k)), dtype=dtypes, seed=seeds,
       unsigned=st.booleans(), scale=st.floats(-4, 3))
def test_activation_codes_are_kitchens(mk, dtype, seed, unsigned, scale):
    M, K = mk
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 10.0 ** scale * torch.rand(K, generator=g).mul(8)).to(dtype)
    smooth = torch.rand(K, generator=g).add(0.2).to(dtype)
    q, s = S.svdquant_activations(x, smooth, unsigned)
    kq, ks, _ = KE.quantize_svdquant_w4a4(x, smooth, torch.zeros(K, 2, dtype=dtype), act_unsigned=unsigned)
    assert_bits(S.pack_int4(q), kq[:M], f"codes {dtype}")
    assert_bits(s.t().contiguous(), ks[:, :M].contiguous(), f"scales {dtype}")
    assert int(q.min()) >= (0 if unsigned else -7) and int(q.max()) <= (15 if unsigned else 7)


@settings(max_examples=25, **COMMON)
@given(nkr=shapes, dtype=dtypes, seed=seeds)
def test_decode_is_kitchens(nkr, dtype, seed):
    N, K, R = nkr
    R = min(R, N, K)
    t0 = storage(N, K, R, dtype, seed, zero_branch=True)      # no branch: no float GEMM, so exact bits
    assert_bits(ours(t0, N, K, dtype).dequantize(), kitchen(t0, N, K, dtype).dequantize(), f"decode {dtype}")
    t = storage(N, K, R, dtype, seed)
    mine, theirs = ours(t, N, K, dtype).dequantize(), kitchen(t, N, K, dtype).dequantize()
    assert ((mine.float() - theirs.float()).abs() <= branch_bound(t, dtype, theirs, R)).all()
    for out in DTYPES: assert same_bits(ours(t, N, K, dtype).dequantize(out), mine.to(out))


@settings(max_examples=20, **COMMON)
@given(nkr=shapes, m=st.integers(1, 24), dtype=dtypes, seed=seeds, unsigned=st.booleans(), bias=st.booleans())
def test_linear_is_kitchens_eager_linear(nkr, m, dtype, seed, unsigned, bias):
    "Two float GEMMs (the W4A4 product and the branch): a bound of the roundings to the dtype and of K + R fp32 sums."
    N, K, R = nkr
    R = min(R, N, K)
    t = storage(N, K, R, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, m, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    cfg = {"format": FMT, "act_unsigned": True} if unsigned else None
    qt, kq = ours(t, N, K, dtype, cfg), kitchen(t, N, K, dtype, unsigned)
    with ck.use_backend("eager"): ref = F.linear(x, kq, b)
    y = F.linear(x, qt, b)
    assert y.shape == ref.shape == (2, m, N) and y.dtype == ref.dtype == dtype
    x2 = x.reshape(-1, K)
    q, sa = S.svdquant_activations(x2 + S.GELU_SHIFT if unsigned else x2, t["weight_smooth_factor"], unsigned)
    a = (q.float().view(len(x2), -1, 64) * sa.float().unsqueeze(-1)).view(len(x2), K).abs()
    mm = a @ S.residual_weight(t["weight"], t["weight_scale"]).float().abs().t()          # |operands| of each GEMM
    mm += (x2.float() @ t["weight_proj_down"].float()).abs() @ t["weight_proj_up"].float().abs().t()
    # each of the GEMM result, the branch and their sum is rounded to `dtype` once; the fp32 accumulations differ by order
    eps = torch.finfo(dtype).eps
    lim = 2 * eps * ref.float().abs() + (2 * eps + 2 * (K + R) * 2.0 ** -23) * mm.view(2, m, N)
    assert ((y.float() - ref.float()).abs() <= lim).all()


@settings(max_examples=10, **COMMON)
@given(tiles=st.integers(1, 2), kg=st.integers(1, 3), r=st.integers(1, 8), dtype=dtypes, seed=seeds)
def test_tile_packed_read(tiles, kg, r, dtype, seed):
    "Our tile packing is what kitchen unpacks; a tile-packed file decodes and runs as its natural twin, in both."
    N, K = 128 * tiles, 64 * kg
    t = storage(N, K, r, dtype, seed)
    q4, s3, u3 = S.tile_pack(t["weight"], t["weight_scale"], t["weight_proj_up"])
    assert tuple(q4.shape) == (tiles, kg, 32, 128) and tuple(s3.shape) == (tiles, kg, 128) and tuple(u3.shape) == (tiles, r, 128)
    assert torch.equal(KE._tile_packed_weight_to_row_major(q4), t["weight"])
    assert torch.equal(KE._tile_packed_scales_to_natural(s3), t["weight_scale"])
    assert torch.equal(KE._tile_packed_lora_up_to_natural(u3), t["weight_proj_up"])
    tt = {**t, "weight": q4, "weight_scale": s3, "weight_proj_up": u3}
    tiled = ours(tt, N, K, dtype, {"format": FMT, "layout": S.TILE_PACKED})
    assert tiled.shape == (N, K) and tiled.config == {"format": FMT, "rank": r, "layout": S.TILE_PACKED}
    assert_bits(tiled.dequantize(), ours(t, N, K, dtype).dequantize(), "tile-packed decode")
    assert_bits(kitchen(tt, N, K, dtype).dequantize(), kitchen(t, N, K, dtype).dequantize(), "kitchen tile-packed")
    back = cq.load_quantized({**{f"m.{k}": v for k, v in tiled.state_dict("").items()},
                              "m.comfy_quant": cq.encode_json(tiled.config)}, "m.", dtype=dtype)
    assert back.shape == (N, K) and all(same_bits(back.state_dict("")[k], v) for k, v in tt.items())


def test_tile_packed_needs_the_layout_field_and_n_128():
    t = storage(128, 64, 4, torch.bfloat16, 0)
    q4, s3, u3 = S.tile_pack(t["weight"], t["weight_scale"], t["weight_proj_up"])
    sd = {"m.weight": q4, "m.weight_scale": s3, "m.weight_proj_down": t["weight_proj_down"], "m.weight_proj_up": u3,
          "m.weight_smooth_factor": t["weight_smooth_factor"], "m.comfy_quant": cq.encode_json({"format": FMT})}
    with pytest.raises(cq.QuantFormatError, match=r"'m\.weight': expected storage shape \(128, 32\) for logical shape \(128, 64\)"):
        cq.load_quantized(sd, "m.", shape=(128, 64))
    with pytest.raises(cq.QuantFormatError, match=r"N % 128 == 0 for kitchen_tile_packed_w4a4 .* weight shape \(64, 128\), found N=64"):
        cq.quantize(torch.randn(64, 128), FMT, layout=S.TILE_PACKED, name="blk.fc.weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_round_trip(tmp_path, dtype):
    "quantize (calibrated) -> QuantLinear -> save_file -> load_file -> load_quantized_model and kitchen: same values."
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(192, 256).to(dtype)
    x = (torch.randn(64, 192, generator=g) * torch.rand(192, generator=g).mul(6)).to(dtype)
    q = cq.QuantLinear.from_float(lin, FMT, rank=16, calibration=x)
    assert q.quant_config == {"format": FMT, "rank": 16}
    cq.save_file({f"blk.{k}": v for k, v in q.state_dict().items()}, tmp_path / "m.safetensors")
    sd = cq.load_file(tmp_path / "m.safetensors")
    assert sorted(sd) == sorted(f"blk.{k}" for k in ("bias", "comfy_quant", "weight", "weight_proj_down", "weight_proj_up",
                                                      "weight_scale", "weight_smooth_factor"))
    model = cq.load_quantized_model(torch.nn.ModuleDict({"blk": torch.nn.Linear(192, 256).to(dtype)}), sd)
    assert model["blk"].format == FMT
    assert_bits(model["blk"](x), q(x), "QuantLinear after the file")
    back = cq.load_quantized(sd, "blk.", dtype=dtype)
    assert_bits(back.dequantize(), q.weight.dequantize(), "decode after the file")
    t = {k[4:]: v for k, v in sd.items() if k.startswith("blk.weight")}
    kd = kitchen(t, 256, 192, dtype).dequantize()
    assert ((kd.float() - back.dequantize().float()).abs() <= branch_bound(t, dtype, kd, 16)).all()
    report = inspect_checkpoint(str(tmp_path / "m.safetensors"))
    assert report["comfy_unloadable"] == {FMT: 1}
    assert f"1 module(s) use {FMT}, which ComfyUI's core loader does not register" in format_inspect(report)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_rank_leaves_no_residual(dtype):
    "rank = min(N, K) and smoothing 1: the branch is W itself, so the codes are 0 and the decode is W to rounding."
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    qt = cq.quantize(w, FMT, rank=64)
    err = (qt.dequantize(torch.float32) - w.float()).abs().max() / w.float().abs().max()
    assert err < 8 * torch.finfo(dtype).eps, err
    res = 7 * qt.params.scale.float().abs().max() / w.float().abs().max()      # the residual left for the int4 codes
    assert res < 8 * torch.finfo(dtype).eps, res


def test_calibration_beats_data_free_on_outlier_channels():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 256, generator=g)
    boost = torch.ones(256); boost[torch.randperm(256, generator=g)[:8]] = 40.0     # a few outlier input channels
    x, xe = torch.randn(256, 256, generator=g) * boost, torch.randn(128, 256, generator=g) * boost
    ref = xe @ w.t()
    cal = cq.sqnr(ref, F.linear(xe, cq.quantize(w, FMT, calibration=x)))
    free = cq.sqnr(ref, F.linear(xe, cq.quantize(w, FMT)))
    conv = cq.sqnr(ref, F.linear(xe, cq.quantize(w, "convrot_w4a4")))
    assert cal > free + 3 and cal > conv, (cal, free, conv)


def test_quantize_model_calibrates_and_warns_without_inputs():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    boost = torch.ones(128); boost[::16] = 50.0                   # outlier input channels: smoothing wins on them
    batches = [(torch.randn(16, 128) * boost,) for _ in range(4)]
    q = cq.quantize_model(model, {"0": FMT}, calibration=batches)
    p = q[0].weight.params
    assert q[0].format == FMT and p.alpha is not None and not bool((p.smooth_factor == 1).all())
    with pytest.warns(cq.CalibrationWarning, match="its data-free variant"):
        cq.quantize_model(torch.nn.Sequential(torch.nn.Linear(128, 64)), {"0": FMT}, calibration={"other": torch.randn(4, 8)})


def test_errors_name_module_option_and_shape():
    w, x = torch.randn(64, 128), torch.randn(8, 128)
    cases = [
        (lambda: cq.quantize(torch.randn(64, 100), FMT, name="a.b.weight"),
         r"'a\.b\.weight': expected K % 64 == 0 for svdquant_w4a4 .*weight shape \(64, 100\), found K=100"),
        (lambda: cq.quantize(w, FMT, rank=65, name="a.b.weight"),
         r"'a\.b\.comfy_quant\['rank'\]': expected 1 <= rank <= min\(N, K\) = 64 for weight shape \(64, 128\), found rank=65"),
        (lambda: cq.quantize(w, FMT, rank=0), r"expected 1 <= rank <= min\(N, K\) = 64 .* found rank=0"),
        (lambda: cq.quantize(w, FMT, calibration=torch.randn(8, 64), name="a.b.weight"),
         r"'a\.b\.calibration': expected inputs \[\.\.\., K=128\] for weight shape \(64, 128\), found shape \(8, 64\)"),
        (lambda: cq.quantize(w, FMT, calibration=torch.ones(8, 128, dtype=torch.int32), name="a.b.weight"),
         r"'a\.b\.calibration': expected a float tensor .* found dtype torch\.int32"),
        (lambda: cq.quantize(w, FMT, calibration=torch.full((4, 128), float("inf")), name="a.b.weight"),
         r"a\.b\.calibration: 512 non-finite value\(s\)"),
        (lambda: cq.quantize(torch.full((64, 128), float("nan")), FMT, name="a.b.weight"), r"a\.b\.weight: 8192 non-finite"),
        (lambda: cq.quantize(w, FMT, calibration=x, alpha=-0.5, name="a.b.weight"), r"option alpha'?: expected a number in \[0, 1\]"),
        (lambda: cq.quantize(w, FMT, group_clip="max"), r"expected one of \['absmax', 'mse'\], found 'max'"),
        (lambda: cq.quantize(w, FMT, layout="tiles"), r"comfy_quant\['layout'\]'?: expected one of \[None, 'kitchen_tile_packed_w4a4'\]"),
    ]
    for fn, pat in cases:
        with pytest.raises(ValueError, match=pat): fn()


def test_bad_files_name_module_key_and_shape():
    t = storage(64, 128, 8, torch.bfloat16, 0)
    N, K = 64, 128
    bad = [({"weight_proj_up": torch.zeros(64, 4, dtype=torch.bfloat16)},
            r"'m\.weight_proj_up': expected shape \(64, 8\) for weight \(64, 128\) and rank R=8 \(from weight_proj_down\), found shape \(64, 4\)"),
           ({"weight_scale": torch.ones(3, 64, dtype=torch.bfloat16)}, r"'m\.weight_scale': expected shape \(2, 64\)"),
           ({"weight_smooth_factor": torch.ones(127, dtype=torch.bfloat16)}, r"'m\.weight_smooth_factor': expected shape \(128,\)"),
           ({"weight_proj_down": torch.ones(128, dtype=torch.bfloat16)}, r"'m\.weight_proj_down': expected shape \(K=128, R\) for weight \(64, 128\), found shape \(128,\)"),
           ({"weight_proj_down": torch.ones(128, 8, dtype=torch.int8)}, r"'m\.weight_proj_down': expected a float32, bfloat16 or float16"),
           ({"weight_proj_down": torch.full((128, 8), float("inf"))}, r"'m\.weight_proj_down': expected finite values"),
           ({"weight_smooth_factor": -torch.ones(128)}, r"'m\.weight_smooth_factor': expected finite and > 0"),
           ({"weight_scale": torch.full((2, 64), float("nan"))}, r"'m\.weight_scale': expected finite and >= 0"),
           ({"weight_proj_down": torch.ones(128, 100), "weight_proj_up": torch.ones(64, 100)},
            r"'m\.comfy_quant\['rank'\]': expected 1 <= rank <= min\(N, K\) = 64 for weight shape \(64, 128\), found rank=100")]
    for change, pat in bad:
        with pytest.raises(cq.QuantFormatError, match=pat): ours({**t, **change}, N, K, torch.bfloat16)
    with pytest.raises(cq.QuantFormatError, match=r"'m\.comfy_quant\['rank'\]': expected the rank of weight_proj_down \(128, 8\), 8, found 16"):
        ours(t, N, K, torch.bfloat16, {"format": FMT, "rank": 16})
    missing = {k: v for k, v in t.items() if k != "weight_smooth_factor"}
    with pytest.raises(cq.QuantFormatError, match=r"'m\.weight_smooth_factor': expected svdquant_w4a4 tensors"):
        ours(missing, N, K, torch.bfloat16)


def test_quantize_checkpoint_writes_calibrated_files(tmp_path):
    "The streaming job with {layer: inputs} writes the calibrated encoder's tensors, loadable by the module layer."
    from dataclasses import replace
    from cquant.calibrate import Calibration
    from cquant.policy import Plan
    model = cq.dit_model(0)
    src = tmp_path / "float.safetensors"
    cq.save_file(model.state_dict(), src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = cq.Policy(mode="int4_full").plan(cq.load_file(src))
    layers = [n for n, d in plan.items() if d.format is not None][:3]
    svd = {n: replace(d, format=FMT, config={"format": FMT}, options={}) if n in layers else replace(d, format=None, config=None)
           for n, d in plan.items()}
    svd = Plan(svd, plan.policy, plan.preset, plan.keep_float, plan.int4_sensitive, plan.note, plan.budget)
    cal = Calibration.of(cq.dit_batches(1, 2, 64, seed=1)).prepare(model, {n: FMT for n in layers}, set(layers))
    inputs = {n: cal.layer_inputs(n) for n in layers}
    cq.quantize_checkpoint(src, tmp_path / "q.safetensors", plan=svd, calibration=inputs, progress=False, measure=False)
    sd = cq.load_file(tmp_path / "q.safetensors")
    for n in layers:
        assert cq.decode_json(sd[f"{n}.comfy_quant"])["format"] == FMT
        want = cq.quantize(model.get_submodule(n).weight.detach(), FMT, calibration=inputs[n], name=f"{n}.weight")
        got = cq.load_quantized(sd, n, dtype=want.dtype)
        assert all(same_bits(got.state_dict("")[k], v) for k, v in want.state_dict("").items()), n
    q = cq.load_quantized_model(cq.dit_model(0), sd)
    assert sorted(n for n, m in q.named_modules() if getattr(m, "format", None) == FMT) == sorted(layers)


def test_unsigned_grid_for_gelu_inputs():
    "Post-GELU inputs: the encoder picks act_unsigned, the shift adds ~nothing (zero weighted sums), and the error drops."
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g)
    x, xe = F.gelu(torch.randn(256, 256, generator=g) * 2), F.gelu(torch.randn(128, 256, generator=g) * 2)
    ref = xe @ w.t()
    qt = cq.quantize(w, FMT, calibration=x)
    signed = cq.quantize(w, FMT, calibration=x * 1 - 1.0)            # shifted below the grid: the signed grid only
    assert qt.params.act_unsigned and qt.config == {"format": FMT, "rank": 32, "act_unsigned": True}
    assert not signed.params.act_unsigned
    p = qt.params
    v = 1 / p.smooth_factor.double()
    shift = S.residual_weight(qt.qdata, p.scale).double() @ v * S.GELU_SHIFT      # what the shift adds to each output
    assert shift.abs().max() < 1e-2 * ref.pow(2).mean().sqrt(), shift.abs().max()
    fixed_alpha = cq.quantize(w, FMT, calibration=x, alpha=0.5)     # alpha given: both grids still tried
    assert fixed_alpha.params.act_unsigned and fixed_alpha.params.alpha == 0.5
    err = lambda q: cq.sqnr(ref, F.linear(xe, q))
    signed_free, unsigned_free = err(cq.quantize(w, FMT)), err(cq.quantize(w, FMT, act_unsigned=True))
    assert unsigned_free > signed_free + 2 and err(qt) >= unsigned_free - 0.5, (err(qt), unsigned_free, signed_free)
    assert err(qt) > err(cq.quantize(w, "convrot_w4a4")) + 5
