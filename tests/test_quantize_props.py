"""Property tests (hypothesis) of `cq.quantize` / `load_quantized` across every registered format.

For random shapes valid for the format, random input dtypes and random magnitudes (1e-6 .. 1e4):

- the file round trip `load_quantized(state_dict + comfy_quant)` decodes bit-identically, in every dtype;
- `dequantize` has the logical shape and the requested dtype, and is finite;
- SQNR on Gaussian data stays above a loose per-format floor;
- inf / NaN inputs raise a ValueError naming the tensor; an all-zero weight decodes to exact zeros;
- unknown option names and wrong option types raise an error naming the option.
"""
from __future__ import annotations
import math
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

import cquant as cq
from cquant.numerics import sqnr
from cquant.tensor import same_bits

EXPECTED_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Loose SQNR floors (dB) on Gaussian weights, far below what each format reaches (e4m3 ~31.5, e5m2 ~25.5, nvfp4 ~20.4,
# mxfp8 ~31.5, int8 ~40, per-row ~42 on 4096-wide Gaussian rows): they catch broken scales, not small regressions.
SQNR_FLOOR = {"float8_e4m3fn": 25.0, "float8_e5m2": 19.0, "nvfp4": 15.0, "mxfp8": 25.0, "int8_tensorwise": 30.0,
              "float8_e4m3fn_rowwise": 25.0, "float8_e4m3fn_blockwise": 25.0, "hybrid_mxfp8": 25.0, "int8_blockwise": 30.0}
DEFAULT_FLOOR = 5.0          # a format registered later without its own floor yet


def _variants():
    "(id, format, options, K unit) for every registered format, with the int8 per-row and ConvRot variants."
    out = []
    for f in sorted(set(cq.FORMATS) | set(EXPECTED_FORMATS)):
        known = f in EXPECTED_FORMATS
        out.append((f, f, {}, 1 if known else 256))
        if f == "int8_tensorwise":
            out.append(("int8_per_row", f, {"per_row": True}, 1))
            out += [(f"int8_convrot{g}", f, {"convrot": True, "convrot_groupsize": g}, g) for g in (16, 64, 256)]
    return out

VARIANTS = _variants()
PARAMS = [pytest.param(f, o, u, id=i) for i, f, o, u in VARIANTS]


def need(fmt):
    assert fmt in cq.FORMATS, f"format {fmt!r} is not registered (have {sorted(cq.FORMATS)})"
    return cq.FORMATS[fmt]


def row_unit(spec, opts) -> int:
    "The least N a weight of the format may have with `opts` (block-wise formats: whole tiles of rows)."
    return next(n for n in (1, 8, 16, 32, 64, 128, 256) if valid(spec, (n, 256), opts))


def n_rows(n:int, nunit:int) -> int:
    "A row count from a drawn `n`: `n` itself, or 1 to 3 whole tiles of `nunit` rows (keeps block-wise cases small)."
    return n if nunit == 1 else nunit * (1 + n % 3)


def shapes(unit, nunit=1):
    "Valid (N, K) for a format whose K must be a multiple of `unit` and N of `nunit`."
    kmax = max(1, 300 // unit)
    return st.tuples(st.integers(1, max(1, 40 // nunit)).map(lambda n: n * nunit), st.integers(1, kmax).map(lambda k: k * unit))


def weight(shape, dtype, exp10, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g).clamp(-6, 6) * 10.0 ** exp10).to(dtype)


def valid(spec, shape, opts):
    try: spec.layout.check_shape(tuple(shape), spec.resolve(None, **opts), '')
    except ValueError: return False
    return True


COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
dtypes = st.sampled_from(DTYPES)
magnitudes = st.floats(-6, 4)
seeds = st.integers(0, 2**31 - 1)


@pytest.mark.parametrize("fmt,opts,unit", PARAMS)
@settings(max_examples=30, **COMMON)
@given(data=st.data(), dtype=dtypes, exp10=magnitudes, seed=seeds)
def test_roundtrip_shape_dtype(fmt, opts, unit, data, dtype, exp10, seed):
    spec = need(fmt)
    shape = data.draw(shapes(unit, row_unit(spec, opts)), label="shape")
    assume(valid(spec, shape, opts))
    w = weight(shape, dtype, exp10, seed)
    qt = cq.quantize(w, fmt, **opts)
    assert qt.format == fmt and tuple(qt.shape) == shape and qt.dtype == dtype
    dq = qt.dequantize()
    assert tuple(dq.shape) == shape and dq.dtype == dtype
    assert bool(torch.isfinite(dq).all()), f"{fmt} {opts} {dtype} 1e{exp10:.2f}: non-finite decode"
    sd = {**qt.state_dict("blk.3.ff."), "blk.3.ff.comfy_quant": cq.encode_json(qt.config)}
    assert set(sd) - {"blk.3.ff.comfy_quant"} <= {"blk.3.ff." + k for k in spec.weight_keys}
    out = data.draw(dtypes, label="load dtype")
    back = cq.load_quantized(sd, "blk.3.ff.", shape=shape, dtype=out)
    assert back.format == fmt and tuple(back.shape) == shape and back.dtype == out
    assert back.config == qt.config
    d2 = back.dequantize()
    assert tuple(d2.shape) == shape and d2.dtype == out
    assert same_bits(d2, qt.dequantize(out)), f"{fmt} {opts}: reload decodes differently in {out}"
    a, b = back.state_dict(""), qt.state_dict("")
    assert sorted(a) == sorted(b) and all(same_bits(a[k], b[k]) for k in a), f"{fmt} {opts}: reload changes file entries"


@pytest.mark.parametrize("fmt,opts,unit", PARAMS)
@settings(max_examples=20, **COMMON)
@given(n=st.integers(8, 40), kmul=st.integers(1, 4), dtype=dtypes, exp10=magnitudes, seed=seeds)
@example(n=32, kmul=4, dtype=torch.float16, exp10=-6.0, seed=0)     # fp16 corners: scales below fp16's normal range
@example(n=32, kmul=4, dtype=torch.float16, exp10=-5.0, seed=0)
@example(n=32, kmul=4, dtype=torch.float16, exp10=-4.0, seed=0)
@example(n=32, kmul=4, dtype=torch.float16, exp10=-3.0, seed=0)
@example(n=32, kmul=4, dtype=torch.float16, exp10=4.0, seed=0)      # near fp16's max
@example(n=32, kmul=4, dtype=torch.bfloat16, exp10=-6.0, seed=0)
def test_sqnr_floor_gaussian(fmt, opts, unit, n, kmul, dtype, exp10, seed):
    """Gaussian weights of any magnitude keep a loose SQNR floor, both for the codes (decoded in fp32) and for the
    tensor a user gets (decoded in the logical dtype; for fp16 at 1e-6 the fp16 grid itself limits this to ~35 dB)."""
    spec = need(fmt)
    shape = (n_rows(n, row_unit(spec, opts)), kmul * max(unit, 64))
    assume(valid(spec, shape, opts))
    w = weight(shape, dtype, exp10, seed)
    qt = cq.quantize(w, fmt, **opts)
    floor = SQNR_FLOOR.get(fmt, DEFAULT_FLOOR)
    where = f"{fmt} {opts} {dtype} shape {shape} magnitude 1e{exp10:.2f} (max|w| {float(w.abs().max()):.3g})"
    s32, s = sqnr(w, qt.dequantize(torch.float32)), sqnr(w, qt.dequantize())
    assert s32 >= floor and s >= floor, f"{where}: SQNR {s32:.2f} dB (fp32 decode), {s:.2f} dB ({dtype} decode) < {floor}"


@pytest.mark.parametrize("fmt,opts,unit", PARAMS)
@settings(max_examples=10, **COMMON)
@given(data=st.data(), dtype=dtypes, bad=st.sampled_from([float("inf"), float("-inf"), float("nan")]), seed=seeds)
def test_nonfinite_raises_naming_tensor(fmt, opts, unit, data, dtype, bad, seed):
    spec = need(fmt)
    shape = data.draw(shapes(unit, row_unit(spec, opts)), label="shape")
    assume(valid(spec, shape, opts))
    w = weight(shape, dtype, 0, seed)
    i, j = data.draw(st.integers(0, shape[0] - 1)), data.draw(st.integers(0, shape[1] - 1))
    w[i, j] = bad
    with pytest.raises(ValueError, match=r"encoder\.layers\.7\.fc1\.weight"):
        cq.quantize(w, fmt, name="encoder.layers.7.fc1.weight", **opts)
    with pytest.raises(ValueError, match=rf"index \({i}, {j}\)"):
        cq.quantize(w, fmt, **opts)


@pytest.mark.parametrize("fmt,opts,unit", PARAMS)
@settings(max_examples=8, **COMMON)
@given(data=st.data(), dtype=dtypes)
def test_all_zero_decodes_to_zeros(fmt, opts, unit, data, dtype):
    spec = need(fmt)
    shape = data.draw(shapes(unit, row_unit(spec, opts)), label="shape")
    assume(valid(spec, shape, opts))
    qt = cq.quantize(torch.zeros(shape, dtype=dtype), fmt, **opts)
    for out in DTYPES:
        dq = qt.dequantize(out)
        assert dq.dtype == out and bool((dq == 0).all()), f"{fmt} {opts}: zero weight decodes to {dq.unique()}"
    sd = {**qt.state_dict("m."), "m.comfy_quant": cq.encode_json(qt.config)}
    assert bool((cq.load_quantized(sd, "m.", shape=shape, dtype=dtype).dequantize() == 0).all())


def bad_values(o) -> list:
    "Values of a clearly wrong type (or outside the choices) for option `o`."
    want = o.type if isinstance(o.type, tuple) else (o.type,)
    vals = [[1.0]]
    if str not in want: vals.append("yes")
    else: vals.append(3)
    if float not in want: vals.append(16.5)
    if bool not in want: vals.append(True)
    if o.choices:   # right type, not one of the choices
        vals += [v for v in ("no_such_choice", -12345) if isinstance(v, want) and v not in o.choices][:1]
    return vals


@pytest.mark.parametrize("fmt,opts,unit", PARAMS)
@settings(max_examples=8, **COMMON)
@given(data=st.data(), name=st.text("abcdefghijklmnopqrstuvwxyz_", min_size=2, max_size=12).map(lambda s: "x_" + s))
def test_option_errors_name_the_option(fmt, opts, unit, data, name):
    spec = need(fmt)
    assume(name not in spec.option_names)
    shape = (max(4, row_unit(spec, opts)), 256)
    w = weight(shape, torch.float32, 0, 0)
    with pytest.raises(ValueError, match=name):
        cq.quantize(w, fmt, **{**opts, name: 1})
    if not spec.options: return
    o = data.draw(st.sampled_from(spec.options), label="option")
    bad = data.draw(st.sampled_from(bad_values(o)), label="bad value")
    with pytest.raises(ValueError, match=o.name):
        cq.quantize(w, fmt, **{**opts, o.name: bad})
    if o.stored:   # the same mistake in a file's comfy_quant names the option too
        qt = cq.quantize(w, fmt, **opts)
        sd = {**qt.state_dict("m."), "m.comfy_quant": cq.encode_json({**qt.config, o.name: bad})}
        with pytest.raises(ValueError, match=o.name):
            cq.load_quantized(sd, "m.", shape=shape, dtype=torch.float32)


# Formats that check finiteness after encoding (`Format.flags_nonfinite`): the error must be check_finite's, exactly,
# for any count and magnitude of bad values, in `quantize` and in the converter's row blocks (whole-weight indices).
FLAGGED = [pytest.param(f, o, u, id=i) for i, f, o, u in VARIANTS if f in cq.FORMATS and cq.FORMATS[f].flags_nonfinite]


def test_flagged_formats_are_the_rotated_and_int8_ones():
    assert {p.values[0] for p in FLAGGED} == {"int8_tensorwise", "convrot_w4a4", "asym_w4a8_int8", "w6a8_int8",
                                              "float8_e4m3fn_rowwise", "float8_e4m3fn_blockwise", "int8_blockwise"}


@pytest.mark.parametrize("fmt,opts,unit", FLAGGED)
@settings(max_examples=25, **COMMON)
@given(data=st.data(), dtype=dtypes, exp10=magnitudes, seed=seeds, count=st.integers(1, 6))
@example(data=None, dtype=torch.float16, exp10=4.0, seed=1, count=1).via("fp16 near its max: rotations overflow")
def test_flagged_nonfinite_is_named_exactly(fmt, opts, unit, data, dtype, exp10, seed, count):
    from cquant.jobs import quantize_rows
    from cquant.tensor import check_finite
    spec = need(fmt)
    if data is None: shape, picks = (n_rows(40, row_unit(spec, opts)), 4 * max(unit, 64)), [(7, 5)]
    else:
        shape = (n_rows(data.draw(st.integers(8, 64), label="N"), row_unit(spec, opts)), data.draw(st.integers(1, 4), label="k") * max(unit, 64))
        picks = [(data.draw(st.integers(0, shape[0] - 1)), data.draw(st.integers(0, shape[1] - 1))) for _ in range(count)]
    assume(valid(spec, shape, opts))
    w = weight(shape, dtype, exp10, seed)
    g = torch.Generator().manual_seed(seed)
    for i, j in picks: w[i, j] = (float("nan"), float("inf"), float("-inf"))[int(torch.randint(3, (), generator=g))]
    with pytest.raises(ValueError) as want: check_finite(w, "blk.2.fc.weight")
    with pytest.raises(ValueError) as got: cq.quantize(w, fmt, name="blk.2.fc.weight", **opts)
    assert str(got.value) == str(want.value)
    if spec.rows_independent(spec.resolve(None, **opts)):
        with pytest.raises(ValueError) as rows: list(quantize_rows(w, fmt, opts, "blk.2.fc.weight", elems=shape[1] * 3))
        assert str(rows.value) == str(want.value)


def test_expected_formats_registered():
    missing = [f for f in EXPECTED_FORMATS if f not in cq.FORMATS]
    assert not missing, f"not registered: {missing}"
