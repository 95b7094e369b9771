"""Triton FP8 kernels vs the eager reference (`cquant.fp8.FP8Layout`), run on CPU through Triton's interpreter.

Quantize and dequantize must be bit-exact; the linear must stay within `fp8_linear_error_bound` (two fp32
summation orders plus the output cast) and be bit-exact where the sums are exact. TRITON_INTERPRET is set
before `cquant.kernels` is imported (here and in conftest.py) when there is no CUDA GPU.
"""
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

from cquant.fp8 import FP8Layout, FP8E5M2Layout, FP8Params, quantize_per_tensor_fp8
from cquant.numerics import absmax, fp8_max
from cquant.tensor import FORMATS, same_bits, test_bits as _bits
import cquant.kernels.fp8 as K

# Triton's interpreter on CPU: the full tier; the quick tier checks each kernel in its notebook (nbs/3N_kernels_*)
pytestmark = pytest.mark.long

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def _cpu(t): return t.cpu()
def _d(t): return None if t is None else t.to(DEV)


def _check_quantize(w, f8, scale=None):
    q, s = K.fp8_quantize(w.to(DEV), f8, scale, cuda_div=False)
    qe, pe = FP8Layout.quantize(w, 0, f8, scale)
    _bits(_cpu(q), qe, f'{w.dtype} {f8} bytes')
    _bits(_cpu(s), pe.scale, f'{w.dtype} {f8} scale')
    return pe.scale


@pytest.mark.parametrize('f8', F8)
def test_rounding_every_fp16_value(f8):
    "Scale 1.0: every finite fp16 value (grid points, midpoints, clamped values, subnormals) and its fp32 neighbours."
    h = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = h[h.isfinite()].float()
    v = torch.cat([h, h.nextafter(torch.tensor(float('inf'))), h.nextafter(torch.tensor(-float('inf'))),
                   torch.tensor([1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 0.0, -0.0])])
    _check_quantize(v, f8, scale=1.0)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('f8', F8)
def test_quantize_bit_exact(dtype, f8):
    g = torch.Generator().manual_seed(DTYPES.index(dtype) * 2 + F8.index(f8))
    fi = torch.finfo(dtype)
    for w in (torch.randn(37, 301, generator=g) * 3,                      # ragged: the last block is masked
              torch.randn(2, 3, 50, generator=g),                         # 3-D
              torch.randn(4097, generator=g) * 0.1,                       # just past one block
              torch.zeros(5, 7),                                          # scale 1.0
              torch.randn(9, 50, generator=g) * 1e-5,                     # fp16: dtype(1/s) overflows -> fp32 path
              torch.randn(9, 50, generator=g) * 1e-39,                    # fp32 / bf16 subnormal values and scale
              torch.randn(9, 50, generator=g).clamp(-1, 1) * fi.max,      # near the dtype's largest value
              torch.tensor([[-0.0, 0.0, 1.0, -1.0]])):                    # signed zeros
        _check_quantize(w.to(dtype), f8)
    _check_quantize(torch.randn(3, 40, generator=g).to(dtype), f8, scale=0.013)          # user scales
    _check_quantize(torch.randn(3, 40, generator=g).to(dtype), f8, scale=torch.tensor([2.0 ** -20]))


def test_quantize_scale_regimes():
    "The zero weight gets 1.0; a tiny fp16 e5m2 weight gets an fp32 scale that fp16 cannot invert."
    assert _check_quantize(torch.zeros(3, 8, dtype=torch.bfloat16), torch.float8_e4m3fn).item() == 1.0
    s = _check_quantize((torch.randn(8, 64) * 1e-3).half(), torch.float8_e5m2)
    assert not torch.isfinite((1 / s).half())


def _cuda_eager_quantize(w, f8):
    "FP8Layout.quantize with torch's CUDA scalar division: times the fp32 reciprocal of the fp8 max."
    r = torch.tensor(1.0) / torch.tensor(fp8_max(f8))
    s = (absmax(w).float() * r).to(w.dtype).float()
    if not bool(torch.isfinite((1.0 / s).to(w.dtype))):
        s = absmax(w).float() * r
        if float(s) == 0: s = torch.ones(())
    return quantize_per_tensor_fp8(w, s, f8), s


@pytest.mark.parametrize('dtype', DTYPES)
def test_quantize_cuda_division_variant(dtype):
    g = torch.Generator().manual_seed(11)
    for i, f8 in enumerate(F8 * 4):
        w = (torch.randn(8, 64, generator=g) * (i + 1) * (1e-4 if i == 7 else 1)).to(dtype)
        q, s = K.fp8_quantize(w.to(DEV), f8, cuda_div=True)
        qe, se = _cuda_eager_quantize(w, f8)
        _bits(_cpu(q), qe); _bits(_cpu(s), se)


def test_quantize_errors():
    with pytest.raises(ValueError, match='float32, float16 or bfloat16'):
        K.fp8_quantize(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match='empty'):
        K.fp8_quantize(torch.zeros(0, 4))
    with pytest.raises(ValueError, match='positive finite'):
        K.fp8_quantize(torch.ones(2, 4), scale=-1.0)


def _bits_nan(a, b, what=''):
    "Same bits, except that NaN payloads may differ (both NaN at the same places)."
    assert torch.equal(a.isnan(), b.isnan()), what
    _bits(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0), what)


@pytest.mark.parametrize('f8', F8)
def test_dequantize_every_byte(f8):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f8).reshape(16, 16)
    for s in (0.0625, 2 / 448 + 1e-9, 3e-7, 1e-30, 1e5, -0.37):
        st = torch.tensor(s)
        for dt in DTYPES:
            out = K.fp8_dequantize(q.to(DEV), st.to(DEV), dt)
            _bits_nan(_cpu(out), FP8Layout.dequantize(q, FP8Params((16, 16), dt, st), dt), f'{f8} {s} {dt}')


@pytest.mark.parametrize('dtype', DTYPES)
def test_dequantize_ragged_and_transposed(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(33, 4100, generator=g).to(dtype)
    q, p = FP8Layout.quantize(w, 0, torch.float8_e4m3fn)
    _bits(_cpu(K.fp8_dequantize(q.to(DEV), p.scale.to(DEV), dtype)), FP8Layout.dequantize(q, p, dtype))
    qt = q[:, :50].t()                                                    # non-contiguous view
    _bits(_cpu(K.fp8_dequantize(qt.to(DEV), p.scale.to(DEV), dtype)), FP8Layout.dequantize(qt, p, dtype))
    assert K.fp8_dequantize(q[:0].to(DEV), p.scale.to(DEV), dtype).shape == (0, 4100)


def _exact_case(dtype, f8, M, N, Kd, g):
    x = torch.randint(-8, 9, (M, Kd), generator=g).to(dtype)
    w = torch.randint(-6, 7, (N, Kd), generator=g).to(dtype)
    qw, p = FP8Layout.quantize(w, 0, f8, scale=0.5)
    b = (torch.randint(-50, 50, (N,), generator=g) / 8).to(dtype)
    return x, qw, p, b


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('f8', F8)
def test_linear_bit_exact_when_sums_are_exact(dtype, f8):
    "Integer bytes and power-of-two scales: every partial sum is exact, so the result must be eager's bits."
    g = torch.Generator().manual_seed(4)
    x, qw, p, b = _exact_case(dtype, f8, 5, 33, 200, g)
    for bias in (b, None):
        ref = FP8Layout.linear(x, qw, p, bias, input_scale=0.25)
        for fuse, fp8_dot in ((True, False), (False, True), (True, True)):
            out = K.fp8_linear(x.to(DEV), qw.to(DEV), p.scale.to(DEV), _d(bias), 0.25, fuse=fuse, fp8_dot=fp8_dot, block_k=64)
            _bits(_cpu(out), ref, f'{dtype} {f8} fuse={fuse} fp8_dot={fp8_dot}')


def _check_linear(x, qw, p, b, isc, **kw):
    out = _cpu(K.fp8_linear(x.to(DEV), qw.to(DEV), p.scale.to(DEV), _d(b), isc, **kw))
    ref = FP8Layout.linear(x, qw, p, b, input_scale=isc)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.double() - ref.double()).abs()
    bound = K.fp8_linear_error_bound(x, qw, p.scale, b, isc)
    assert bool((err <= bound).all()), f'error {err.max().item()} over the bound'
    return out


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('f8', F8)
def test_linear_within_bound(dtype, f8):
    g = torch.Generator().manual_seed(5 + DTYPES.index(dtype))
    x = (torch.randn(2, 3, 300, generator=g) * 3).to(dtype)               # 3-D, K over 3 tiles (ragged)
    qw, p = FP8Layout.quantize(torch.randn(45, 300, generator=g).to(dtype), 0, f8)
    b = torch.randn(45, generator=g).to(dtype)
    for isc in (None, 0.02, torch.tensor([0.5])):                        # None: x clipped at +-max
        _check_linear(x, qw, p, b, isc)
    _check_linear(x, qw, p, None, None, fuse=False)


def test_linear_fused_unfused_and_operand_paths_agree():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(70, 96, generator=g).bfloat16()
    qw, p = FP8Layout.quantize(torch.randn(40, 96, generator=g).bfloat16(), 0, torch.float8_e4m3fn)
    outs = [K.fp8_linear(x.to(DEV), qw.to(DEV), p.scale.to(DEV), None, 0.01, fuse=fu, fp8_dot=fd)
            for fu in (True, False) for fd in ((True, False) if DEV == 'cpu' else (None,))]
    for o in outs[1:]: _bits(_cpu(o), _cpu(outs[0]))
    _bits(_cpu(K.fp8_linear(x.to(DEV), qw.to(DEV), p.scale.to(DEV), None, 0.01)), _cpu(outs[0]))


def test_linear_edges():
    "fp32 bias into a bf16 output, a transposed weight view, 1-D x, no rows, inf and NaN activations, NaN weight bytes."
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, generator=g).bfloat16()
    qw, p = FP8Layout.quantize(torch.randn(64, 24, generator=g), 0, torch.float8_e4m3fn)
    qwt = qw.t()                                                          # [24, 64] non-contiguous
    b = torch.randn(24, generator=g)                                      # fp32 bias, bf16 output
    _check_linear(x, qwt, p, b, None)
    _check_linear(x[0], qwt, p, b, 0.1)
    assert K.fp8_linear(x[:0].to(DEV), qwt.to(DEV), p.scale.to(DEV)).shape == (0, 24)
    xs = x.clone(); xs[0, 0] = float('inf'); xs[1, 3] = -float('inf')     # clipped to +-448
    _check_linear(xs, qwt, p, b, None)
    xn = x.clone(); xn[2, 5] = float('nan')
    wn = qwt.clone(); wn.view(torch.uint8)[7, 3] = 0x7F                  # a NaN byte (kitchen's zero-weight bug)
    out = _cpu(K.fp8_linear(xn.to(DEV), wn.to(DEV), p.scale.to(DEV), _d(b), fp8_dot=False if DEV == 'cpu' else None))
    ref = FP8Layout.linear(xn, wn, p, b)
    assert torch.equal(out.isnan(), ref.isnan()) and bool(out.isnan().any())
    ok = ~ref.isnan()
    assert bool(((out.double() - ref.double()).abs()[ok] <= K.fp8_linear_error_bound(x, wn, p.scale, b)[ok]).all())


def test_linear_errors():
    with pytest.raises(ValueError, match='fp8_linear'):
        K.fp8_linear(torch.zeros(2, 5), torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.tensor(1.0))
    with pytest.raises(ValueError, match='bias'):
        K.fp8_linear(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.tensor(1.0), torch.zeros(4))
    with pytest.raises(ValueError, match='input_scale'):
        K.fp8_linear(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.tensor(1.0), None, 0.0)


def test_fast_paths():
    "Every FAST_PATHS entry gives the classmethod's result (bits; the linear within its bound), and fits declines what it must."
    assert [(layout, op) for layout, op, _, _ in K.FAST_PATHS] == [
        (FP8Layout, 'quantize'), (FP8E5M2Layout, 'quantize'), (FP8Layout, 'dequantize'), (FP8Layout, 'linear'),
        (FP8E5M2Layout, 'dequantize'), (FP8E5M2Layout, 'linear')]
    g = torch.Generator().manual_seed(8)
    entries = {(layout, op): (fn, fits) for layout, op, fn, fits in K.FAST_PATHS}
    for name in ('float8_e4m3fn', 'float8_e5m2'):
        spec = FORMATS[name]
        L = spec.layout
        assert L.fp8_dtype == spec.storage.dtype and issubclass(L, FP8Layout)
        for dt in DTYPES:
            w = torch.randn(33, 70, generator=g).to(dt)
            x = torch.randn(3, 70, generator=g).to(dt)
            b = torch.randn(33, generator=g).to(dt)
            fn, fits = entries[L, 'quantize']
            for scale in (None, 0.02):
                kw = dict(stochastic_rounding=0, scale=scale)
                assert fits(w, **kw)
                q, params = fn(w.to(DEV), **kw)
                qe, pe = L.quantize(w, **kw)
                assert type(params) is FP8Params and params.orig_shape == pe.orig_shape and params.orig_dtype == pe.orig_dtype
                _bits(_cpu(q), qe); _bits(_cpu(params.scale), pe.scale)
            assert not fits(w, stochastic_rounding=1)
            assert not fits(w.double(), stochastic_rounding=0)
            assert not fits(w[:0], stochastic_rounding=0)
            with pytest.raises(ValueError, match='stochastic'):
                fn(w, stochastic_rounding=1)
            fn, fits = entries[L, 'dequantize']
            pd = FP8Params(pe.orig_shape, pe.orig_dtype, pe.scale.to(DEV))
            for out_dt in DTYPES:
                assert fits(qe, pe, out_dt)
                _bits(_cpu(fn(qe.to(DEV), pd, out_dt)), L.dequantize(qe, pe, out_dt))
            assert not fits(qe, pe, torch.float64) and not fits(qe.float(), pe, dt)
            assert not fits(qe, FP8Params(pe.orig_shape, dt, pe.scale.double()), dt)
            fn, fits = entries[L, 'linear']
            for isc in (None, 0.05):
                assert fits(x, qe, pe, b, isc)
                out = _cpu(fn(x.to(DEV), qe.to(DEV), pd, b.to(DEV), isc))
                ref = L.linear(x, qe, pe, b, isc)
                assert out.dtype == ref.dtype and out.shape == ref.shape
                assert bool(((out.double() - ref.double()).abs() <= K.fp8_linear_error_bound(x, qe, pe.scale, b, isc)).all())
            assert not fits(x, qe.reshape(-1), pe, b)                    # not 2-D: eager's generic linear
            assert not fits(x[:, :69], qe, pe, b)                        # K mismatch: eager raises
            assert not fits(x, qe, pe, b[:5]) and not fits(x, qe, pe, b.double()) and not fits(x.double(), qe, pe, b)
            assert not fits(x[:, :0], qe[:, :0], pe)                     # K == 0
