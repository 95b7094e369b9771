"""Triton W4A8 / W6A8 kernels (`cquant.kernels.w4a8`) vs the eager reference (`cquant.w4a8`).

Run on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before anything is imported
when there is no CUDA). Skipped when triton is not installed.
"""
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

import cquant as cq
from cquant.w4a8 import w4a8_int8_grid, dequantize_w4a8, w4a8_linear, w4a8_default_codebook, W4A8Layout, W6A8Layout
from cquant.int8 import int_mm
from cquant.numerics import pack_uint4, pack_6bit
from cquant.tensor import same_bits
import cquant.kernels.w4a8 as K

# huge scales overflow on purpose inside the interpreter's numpy arithmetic (the eager side gives the same inf)
# Triton's interpreter on CPU: the full tier; the quick tier checks each kernel in its notebook (nbs/3N_kernels_*)
pytestmark = [pytest.mark.long, pytest.mark.filterwarnings('ignore:overflow encountered:RuntimeWarning', 'ignore:invalid value encountered:RuntimeWarning')]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
VARIANTS = {'codebook': ('asym_w4a8_int8', {}), 'uniform': ('asym_w4a8_int8', {'codebook': False}),
            'asymmetric': ('asym_w4a8_int8', {'symmetric': False, 'codebook': False}), '6-bit': ('w6a8_int8', {})}
_CACHE = {}


def _qt(variant, wdt=torch.bfloat16, shape=(37, 192), G=16, cg=64, seed=0):
    "A cached cq.quantize'd weight with an outlier input column (N ragged for every tile size)."
    key = (variant, wdt, shape, G, cg, seed)
    if key not in _CACHE:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(*shape, generator=g)
        w[:, 5] *= 40
        fmt, kw = VARIANTS[variant]
        _CACHE[key] = cq.quantize(w.to(wdt), fmt, group_size=G, convrot_groupsize=cg, **kw)
    return _CACHE[key]


def _args(qt):
    p = qt.params
    return [qt.qdata, p.s_rel, p.s_channel, p.bits, p.codebook if isinstance(p.codebook, torch.Tensor) else None,
            p.correction, p.group_size, p.convrot_groupsize]


def _dev(a): return [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in a]


def _bits(a, b): return same_bits(a.cpu(), b)


@pytest.mark.parametrize('bits', [4, 6])
def test_grid_every_scale_byte_and_code(bits):
    "254 non-NaN e4m3 bytes (negative, subnormal, 448) x every code; as fp32 scales too; codebook and uniform."
    b = torch.tensor([x for x in range(256) if x & 127 != 127], dtype=torch.uint8)
    codes = (torch.arange(2 << bits) % (1 << bits)).to(torch.uint8).repeat(b.numel(), 1)
    q = pack_6bit(codes) if bits == 6 else pack_uint4(codes)
    s = b[:, None].repeat(1, codes.shape[1] // 16).view(torch.float8_e4m3fn)
    for cb in ((None, w4a8_default_codebook() * -2.3) if bits == 4 else (None,)):
        for sr in (s, s.float()):
            out = K.w4a8_int8_grid(q.to(DEV), sr.to(DEV), bits, None if cb is None else cb.to(DEV), 16, block_n=128, block_k=32 << bits)
            assert _bits(out, w4a8_int8_grid(q, sr, bits, cb, 16))


def test_grid_fp32_edge_scales():
    "Ties (round half to even), huge (clamped to +-127), tiny, negative and subnormal fp32 scales."
    q = pack_uint4(torch.arange(64).remainder(16).to(torch.uint8).repeat(2, 1))
    s = torch.tensor([[0.5, 1e30, 1e-30, -0.5], [2.0 ** -149, -1e38, 1.5, 17.25]])
    out = K.w4a8_int8_grid(q.to(DEV), s.to(DEV))
    assert _bits(out, w4a8_int8_grid(q, s))
    assert out[0, :16].tolist() == [-4, -4, -3, -2, -2, -2, -1, 0, 0, 0, 1, 2, 2, 2, 3, 4]


@pytest.mark.parametrize('variant', list(VARIANTS))
@pytest.mark.parametrize('G,cg', [(16, 64), (48, 16), (4, 4)])
def test_grid_ragged(variant, G, cg):
    if variant == '6-bit' and G % 16: G = 32
    qt = _qt(variant, G=G, cg=cg)
    a = _args(qt)
    out = K.w4a8_int8_grid(*_dev([a[0], a[1], a[3], a[4]]), a[6], block_n=16, block_k=64)   # 37 rows, 192 columns: ragged both ways
    assert _bits(out, w4a8_int8_grid(a[0], a[1], a[3], a[4], a[6]))


@pytest.mark.parametrize('variant', list(VARIANTS))
@pytest.mark.parametrize('dtype', DTYPES)
def test_dequantize_bit_exact(variant, dtype):
    "Default mode (fused rotation for bf16, torch's otherwise) and forced torch rotation: both bit-exact."
    qt = _qt(variant)
    ref = dequantize_w4a8(*_args(qt), dtype)
    assert _bits(K.dequantize_w4a8(*_dev(_args(qt)), dtype), ref)
    assert _bits(K.dequantize_w4a8(*_dev(_args(qt)), dtype, fuse_rotation=False, block_n=16), ref)


@pytest.mark.parametrize('wdt', [torch.float16, torch.float32])
def test_dequantize_correction_dtypes(wdt):
    "The asymmetric correction keeps the weight's dtype: fp16 / fp32 corrections, into every output dtype."
    qt = _qt('asymmetric', wdt)
    assert qt.params.correction.dtype == wdt
    for dt in DTYPES:
        assert _bits(K.dequantize_w4a8(*_dev(_args(qt)), dt), dequantize_w4a8(*_args(qt), dt))


@pytest.mark.parametrize('cg,G,shape', [(256, 16, (20, 512)), (4, 4, (20, 64)), (1024, 32, (20, 1024)), (64, 48, (20, 192))])
def test_dequantize_bf16_fused_rotation_groups(cg, G, shape):
    "The fused rotation for every kind of group: 256 (4 slices of 64), 4 (block diagonal), 1024 (not fused by default)."
    qt = _qt('codebook' if G % 16 or cg != 1024 else '6-bit', shape=shape, G=G, cg=cg)
    ref = dequantize_w4a8(*_args(qt), torch.bfloat16)
    assert _bits(K.dequantize_w4a8(*_dev(_args(qt)), torch.bfloat16, block_n=32), ref)
    if cg <= 256: assert _bits(K.dequantize_w4a8(*_dev(_args(qt)), torch.bfloat16, fuse_rotation=True, block_n=32), ref)


def _rotation_bound(qt, dt):
    "2 cg 2^-24 S per element (S = sum of |v_j h_j| over the group), see the notebook."
    p = qt.params
    N, Kd, cg = p.s_rel.shape[0], p.s_rel.shape[1] * p.group_size, p.convrot_groupsize
    v = w4a8_int8_grid(qt.qdata, p.s_rel, p.bits, _args(qt)[4], p.group_size).float() * p.s_channel[:, None]
    if p.correction is not None: v = v + p.correction.t().float().repeat_interleave(p.group_size, 1)
    S = v.to(dt).double().abs().reshape(N, -1, cg).sum(-1, keepdim=True).expand(-1, -1, cg).reshape(N, Kd) / cg ** 0.5
    return 2 * cg * 2.0 ** -24 * S


def _ulp(y):
    nm = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[y.dtype]
    return torch.exp2(torch.log2(y.double().abs().clamp_min(torch.finfo(y.dtype).tiny)).floor() - nm)


@pytest.mark.parametrize('variant', ['codebook', 'asymmetric'])
@pytest.mark.parametrize('dtype', DTYPES)
def test_dequantize_forced_fusion_bound(variant, dtype):
    "Forced fused rotation where it is not provably exact: within 2 cg 2^-24 S + 1 ulp of the eager result."
    qt = _qt(variant, shape=(37, 512), cg=256)
    ref = dequantize_w4a8(*_args(qt), dtype)
    out = K.dequantize_w4a8(*_dev(_args(qt)), dtype, fuse_rotation=True).cpu()
    assert bool(((out.double() - ref.double()).abs() <= _rotation_bound(qt, dtype) + _ulp(ref)).all())
    if dtype == torch.bfloat16 and variant == 'codebook': assert same_bits(out, ref)      # the proved case


@pytest.mark.parametrize('dtype', DTYPES)
def test_dequantize_edge_row_scales(dtype):
    "Zero, fp32-subnormal, tiny and huge (inf after the cast) row scales; the default mode stays bit-exact."
    qt = _qt('uniform', shape=(20, 256), cg=256)
    a = _args(qt)
    a[2] = a[2].clone()
    a[2][:6] = torch.tensor([1e-39, 2.0 ** -130, 1e30, 0.0, 1e-6, 6e-8])
    assert _bits(K.dequantize_w4a8(*_dev(a), dtype, block_n=32), dequantize_w4a8(*a, dtype))


def test_dequantize_fp32_s_rel_and_uint8_codes():
    qt = _qt('codebook')
    a = _args(qt)
    a[0], a[1] = a[0].view(torch.uint8), a[1].float()
    assert _bits(K.dequantize_w4a8(*_dev(a), torch.bfloat16), dequantize_w4a8(*_args(qt), torch.bfloat16))


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_mm_integer_accumulation_exact(variant):
    qt = _qt(variant)
    a_ = _args(qt)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-128, 128, (5, 192), dtype=torch.int8, generator=g)
    x[0] = -128
    ref = int_mm(x, w4a8_int8_grid(a_[0], a_[1], a_[3], a_[4], a_[6]).t())
    for blocks in ({}, {'block_k': 64, 'block_n': 16}):
        out = K.w4a8_mm(x.to(DEV), *_dev([a_[0], a_[1], a_[3], a_[4]]), a_[6], **blocks)
        assert out.dtype == torch.int32 and torch.equal(out.cpu(), ref)


@pytest.mark.parametrize('variant', list(VARIANTS))
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('with_bias', [True, False])
def test_linear_bit_exact(variant, dtype, with_bias):
    qt = _qt(variant, dtype)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 192, generator=g).to(dtype)
    x[1] = 0
    x[2, :4] = torch.tensor([1e4, -1e4, 1e-3, 0.5]).to(dtype)
    bias = torch.randn(37, generator=g) if with_bias else None            # fp32 bias: cast to x's dtype, as eager
    a = _args(qt)
    out = K.w4a8_linear(x.to(DEV), *_dev(a[:6]), None if bias is None else bias.to(DEV), *a[6:], block_k=64)
    assert _bits(out, w4a8_linear(x, *a[:6], bias, *a[6:]))


def test_linear_shapes():
    "3-D and 1-D activations, an empty batch, autotuned tiles (the first config when interpreting), G = 48."
    qt = _qt('codebook', G=48, cg=16)
    a = _args(qt)
    g = torch.Generator().manual_seed(6)
    for shape in ((2, 3, 192), (192,), (0, 192)):
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        out = K.w4a8_linear(x.to(DEV), *_dev(a[:6]), None, *a[6:])
        assert out.shape == (*shape[:-1], 37) and _bits(out, w4a8_linear(x, *a[:6], None, *a[6:]))


def test_fast_paths_same_bits_as_classmethods():
    "Every FAST_PATHS entry: fits the ordinary calls and returns the classmethod's bits."
    assert {(l, op) for l, op, _, _ in K.FAST_PATHS} == {(l, op) for l in (W4A8Layout, W6A8Layout) for op in ('dequantize', 'linear')}
    g = torch.Generator().manual_seed(7)
    for variant in VARIANTS:
        qt = _qt(variant)
        for layout, op, fn, fits in K.FAST_PATHS:
            if layout is not qt.layout: continue
            for dt in DTYPES:
                if op == 'dequantize':
                    args = (qt.qdata.to(DEV), qt.params, dt)
                    ref = layout.dequantize(qt.qdata, qt.params, dt)
                else:
                    x, bias = torch.randn(3, 192, generator=g).to(dt), torch.randn(37, generator=g).to(dt)
                    args = (x.to(DEV), qt.qdata.to(DEV), qt.params, bias.to(DEV))
                    ref = layout.linear(x, qt.qdata, qt.params, bias)
                assert fits(*args), (variant, op, dt)
                assert _bits(fn(*args), ref), (variant, op, dt)


def test_fits_declines():
    qt = _qt('codebook')
    x = torch.randn(3, 192)
    assert not K.fits_dequantize(qt.qdata, qt.params, torch.float64)
    assert not K.fits_linear(x.double(), qt.qdata, qt.params)
    assert not K.fits_linear(torch.randn(3, 96), qt.qdata, qt.params)
    assert not K.fits_linear(x, qt.qdata, qt.params, torch.randn(1, 37))
    assert not K.fits_linear(x, qt.qdata, qt.params, torch.randint(0, 3, (37,)))
    assert K.fits_linear(x, qt.qdata, qt.params, torch.randn(37), input_scale=torch.tensor(0.5))


def test_errors():
    qt = _qt('codebook')
    a = _args(qt)
    with pytest.raises(ValueError, match='must be packed as'):
        K.w4a8_int8_grid(a[0][:, :-2], a[1])
    with pytest.raises(ValueError, match='s_rel must be float8_e4m3fn or float32'):
        K.w4a8_int8_grid(a[0], a[1].to(torch.bfloat16))
    with pytest.raises(ValueError, match='features but the weight has K=192'):
        K.w4a8_linear(torch.randn(2, 64), *a[:6], None, *a[6:])
    with pytest.raises(ValueError, match='w4a8_mm: expected int8'):
        K.w4a8_mm(torch.zeros(2, 192), a[0], a[1])
    with pytest.raises(ValueError, match='expected float32, float16 or bfloat16'):
        K.dequantize_w4a8(*a, torch.float64)
