"""Triton ConvRot kernels (`cquant.kernels.convrot`) vs the eager references (`cquant.int8`, `cquant.w4a4`),
run on CPU through Triton's interpreter.

Bit-exactness is checked where it is machine-independent: on inputs whose rotation sums are exact in fp32
(every summation order agrees), and against the eager quantizers applied to `rotate_ordered` (the kernels'
fixed summation order). Against eager's own BLAS rotation on ordinary data, the asserted bounds are the
ones stated in nbs/33_kernels_convrot.ipynb.
"""
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

import cquant.int8 as E8
import cquant.w4a4 as E4
from cquant.int8 import Int8Layout
from cquant.w4a4 import W4A4Layout
from cquant.numerics import rotate, pack_int4, unpack_int4
from cquant.tensor import same_bits
import cquant.kernels.convrot as C
from cquant.kernels.base import recip32

# Triton's interpreter on CPU: the full tier; the quick tier checks each kernel in its notebook (nbs/3N_kernels_*)
pytestmark = pytest.mark.long

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
EPS = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}   # scale bound vs eager's BLAS


def _cpu(t): return t.cpu()
def _gen(seed): return torch.Generator().manual_seed(seed)


def _grid(shape, g, scale=8):
    "Values k/scale, |k| <= 64: every partial sum of a rotation is exact in fp32, so every order agrees."
    return torch.randint(-64, 65, shape, generator=g).float() / scale


def _gauss(shape, g):
    "Gaussian rows with a few outlier input channels (ordinary data: rotation sums round)."
    w = torch.randn(*shape, generator=g) * 0.02
    w[..., torch.randperm(shape[-1], generator=g)[:3]] *= 30
    return w


def _bits(a, b, what=''):
    assert same_bits(_cpu(a), b), what


def test_fast_paths_listed():
    assert {(l, op) for l, op, _, _ in C.FAST_PATHS} == {(L, op) for L in (Int8Layout, W4A4Layout)
                                                          for op in ('quantize', 'dequantize', 'linear')}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [4, 16, 64, 256])
def test_quantize_exact_rotation(dtype, G):
    "INT8 (weights, activations) and int4 (packed weights, unpacked activations): bit-exact, ragged rows, a zero row."
    g = _gen(G)
    w = _grid((37, 256), g).to(dtype)
    w[5] = 0.0
    wd = w.to(DEV)
    q, s = C.quantize_int8_convrot(wd, G, block_m=16)                 # 3 programs, the last one masked
    qe, se = E8.quantize_int8_convrot(w, G)
    _bits(q, qe, 'int8 q'); _bits(s, se, 'int8 scale')
    xa = w.reshape(37, 2, 128) if G <= 128 else w.reshape(37, 1, 256)     # activations with leading dims
    q, s = C.quantize_rows_int8_convrot(xa.to(DEV), G)
    ref = E8.quantize_rows_int8(rotate(xa, G))
    _bits(q, ref[0], 'int8 activations'); _bits(s, ref[1], 'int8 activation scales')
    q, s = C.quantize_w4a4_weight(wd, G, block_m=16)
    qe, se = E4.quantize_w4a4_weight(w, G)
    _bits(q, qe, 'int4 packed'); _bits(s, se, 'int4 scale')
    q, s = C.quantize_rows_int4_convrot(wd, G, pack=False)
    qe, se = E4.quantize_rows_int4(rotate(w, G))
    _bits(q, qe, 'int4 codes'); _bits(s, se.float(), 'int4 activation scales')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [16, 256])
def test_quantize_dot_exact_rotation(dtype, G):
    "The tl.dot rotation (tensor cores on a GPU) gives eager's bits when the sums are exact."
    w = _grid((20, 256), _gen(3)).to(dtype)
    q, s = C.quantize_int8_convrot(w.to(DEV), G, rotation='dot')
    qe, se = E8.quantize_int8_convrot(w, G)
    _bits(q, qe); _bits(s, se)
    q, s = C.quantize_w4a4_weight(w.to(DEV), G, rotation='dot')
    qe, se = E4.quantize_w4a4_weight(w, G)
    _bits(q, qe); _bits(s, se)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [16, 256, 1024])
def test_quantize_equals_eager_of_rotate_ordered(dtype, G):
    "On ordinary data the kernels are the eager quantizers applied to the kernels' summation order (machine-independent)."
    w = _gauss((8, 1024), _gen(G)).to(dtype)
    q, s = C.quantize_int8_convrot(w.to(DEV), G)
    qe, se = E8.quantize_rows_int8(C.rotate_ordered(w, G))
    _bits(q, qe); _bits(s, se)
    q, s = C.quantize_w4a4_weight(w.to(DEV), G)
    qe, se = E4.quantize_rows_int4(C.rotate_ordered(w, G))
    _bits(q, pack_int4(qe)); _bits(s, se.reshape(-1).float())


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [4, 16, 256])
def test_quantize_vs_eager_bound(dtype, G):
    "Against eager's BLAS rotation: codes at most one level apart on <= 1e-3 of them, scales within the stated bound."
    w = _gauss((32, 512), _gen(G + 1)).to(dtype)
    q, s = C.quantize_int8_convrot(w.to(DEV), G)
    qe, se = E8.quantize_int8_convrot(w, G)
    d = (_cpu(q).int() - qe.int()).abs()
    assert d.max() <= 1 and (d > 0).float().mean() <= 1e-3
    assert ((_cpu(s) - se).abs() <= EPS[dtype] * se).all()
    q, s = C.quantize_w4a4_weight(w.to(DEV), G)
    qe, se = E4.quantize_w4a4_weight(w, G)
    d = (unpack_int4(_cpu(q)).int() - unpack_int4(qe).int()).abs()
    assert d.max() <= 1 and (d > 0).float().mean() <= 1e-3
    assert ((_cpu(s) - se).abs() <= EPS[dtype] * se).all()


def test_ordered_loop_equals_vectorized():
    "rotation='ordered_loop' runs the GPU's FMA loop in the interpreter: same bits as the vectorized ordered sum."
    g = _gen(9)
    for G, K in ((4, 64), (16, 64), (256, 256)):
        w = _gauss((3, K), g)
        a = C.quantize_int8_convrot(w.to(DEV), G, rotation='ordered_loop')
        b = C.quantize_int8_convrot(w.to(DEV), G, rotation='ordered')
        _bits(a[0], _cpu(b[0])); _bits(a[1], _cpu(b[1]))
        q8 = torch.randint(-127, 128, (3, K), dtype=torch.int8, generator=g)
        s = torch.rand(3, 1, generator=g)
        _bits(C.dequantize_int8_convrot(q8.to(DEV), s.to(DEV), G, rotation='ordered_loop'), C.rotate_ordered(q8 * s, G))
        q4 = pack_int4(torch.randint(-7, 8, (3, K), dtype=torch.int8, generator=g))
        _bits(C.dequantize_w4a4_weight(q4.to(DEV), s[:, 0].to(DEV), G, rotation='ordered_loop'),
              C.rotate_ordered(unpack_int4(q4) * s, G))


@pytest.mark.parametrize('dtype', DTYPES)
def test_quantize_edge_values(dtype):
    "Halfway quotients, huge and tiny rows (fp16: subnormal int8 scale, int4 scale underflowing to 0), a zero row."
    g = _gen(21)
    H = C.hadamard(4)
    r = torch.zeros(6, 64)                                    # rotated values; x = r H rotates back to r exactly
    r[0, ::4][:6] = torch.tensor([127.0, 63.5, 0.5, -2.5, 1.5, -0.5])    # int8: scale 1, quotients on ties
    r[1, ::4][:5] = torch.tensor([7.0, 3.5, 0.5, -2.5, 1.5])             # int4: scale 1, ties
    x = (r.reshape(6, 16, 4) @ H).reshape(6, 64)
    huge = 2.0 ** 100 if dtype != torch.float16 else 2.0 ** 6
    x[2] = torch.randint(-16, 17, (64,), generator=g).float() * huge
    x[3, :2] = 2.0 ** -24                                     # rotates to (2**-24, 2**-24, 0, 0): fp16 int4 scale -> 0
    x[4] = torch.randint(-16, 17, (64,), generator=g).float() * (2.0 ** -24 if dtype == torch.float16 else 1e-38 / 16)
    x = x.to(dtype)
    q, s = C.quantize_int8_convrot(x.to(DEV), 4)
    qe, se = E8.quantize_int8_convrot(x, 4)
    _bits(q, qe); _bits(s, se)
    assert _cpu(q)[0, ::4][:6].tolist() == [127, 64, 0, -2, 2, 0]
    q4, s4 = C.quantize_w4a4_weight(x.to(DEV), 4)
    q4e, s4e = E4.quantize_w4a4_weight(x, 4)
    _bits(q4, q4e); _bits(s4, s4e)
    assert unpack_int4(_cpu(q4))[1, ::4][:5].tolist() == [7, 4, 0, -2, 2]
    (q, p), (qe, pe) = C._int8_quantize(x.to(DEV), convrot=True, convrot_groupsize=4), Int8Layout.quantize(x, convrot=True, convrot_groupsize=4)
    _bits(q, qe, 'Layout rule'); _bits(p.scale, pe.scale)
    if dtype == torch.float16:                                # both fp16 special cases were exercised
        assert pe.scale[3, 0] < 2.0 ** -14 and qe[3, 0] == 127 and s4e[3] == 0.0 and unpack_int4(q4e)[3, :2].tolist() == [7, 7]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [4, 16, 256])
def test_dequantize(dtype, G):
    "Exact (power-of-two scales) vs eager, any order; ordinary scales vs rotate_ordered; tl.dot within the fp32 sum bound."
    g = _gen(G + 7)
    q8 = torch.randint(-128, 128, (21, 256), dtype=torch.int8, generator=g); q8[3] = 0
    q4 = pack_int4(torch.randint(-8, 8, (21, 256), dtype=torch.int8, generator=g))
    s2 = 2.0 ** -torch.randint(2, 14, (21, 1), generator=g).float()
    _bits(C.dequantize_int8_convrot(q8.to(DEV), s2.to(DEV), G, dtype, block_m=8), E8.dequantize_int8_convrot(q8, s2, G, dtype))
    _bits(C.dequantize_w4a4_weight(q4.to(DEV), s2[:, 0].to(DEV), G, dtype, block_m=8), E4.dequantize_w4a4_weight(q4, s2[:, 0], G, dtype))
    st = torch.tensor(0.0371)                                 # a tensor-wise INT8 scale broadcasts to every row
    _bits(C.dequantize_int8_convrot(q8.to(DEV), st.to(DEV), G, dtype), C.rotate_ordered(q8 * st, G, torch.float32).to(dtype))
    s = torch.rand(21, 1, generator=g) * 0.01
    _bits(C.dequantize_int8_convrot(q8.to(DEV), s.to(DEV), G, dtype), C.rotate_ordered(q8 * s, G, torch.float32).to(dtype))
    _bits(C.dequantize_w4a4_weight(q4.to(DEV), s[:, 0].to(DEV), G, dtype), C.rotate_ordered(unpack_int4(q4) * s, G, torch.float32).to(dtype))
    if G >= 16 and dtype == torch.float32:
        v = q8 * s
        bound = 2 * G * 2.0 ** -24 * (v.abs().reshape(21, -1, G).sum(-1, keepdim=True) / G ** 0.5)
        got = _cpu(C.dequantize_int8_convrot(q8.to(DEV), s.to(DEV), G, rotation='dot'))
        assert ((got - rotate(v, G, as_weight=True)).reshape(21, -1, G).abs() <= bound).all()


@pytest.mark.parametrize('MNK', [(5, 33, 192), (1, 17, 64), (40, 8, 128)])
def test_w4a4_mm_exact(MNK):
    M, N, K = MNK
    g = _gen(M)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g); a[0] = -128
    w = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g); w[0] = -8
    ref = E8.int_mm(a, w.t())
    assert torch.equal(_cpu(C.w4a4_mm(a.to(DEV), pack_int4(w).to(DEV), block_k=64)), ref)
    assert torch.equal(_cpu(C.w4a4_mm(a.to(DEV), pack_int4(w).to(DEV))), ref)
    a4 = torch.randint(-8, 8, (M, K), dtype=torch.int8, generator=g)
    assert torch.equal(_cpu(C.w4a4_mm(pack_int4(a4).to(DEV), pack_int4(w).to(DEV), a_packed=True, block_k=32)), E8.int_mm(a4, w.t()))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('with_bias', [True, False])
def test_linears_exact_rotation(dtype, with_bias):
    "ConvRot W8A8 and both W4A4 linear dtypes (and int4 exact=True): bit-exact, 3-D x, ragged N, bias in any dtype."
    g = _gen(11 + with_bias)
    W = _grid((33, 128), g).to(dtype)
    x = _grid((2, 3, 128), g, 16).to(dtype)
    bias = torch.randn(33, generator=g) if with_bias else None
    bd = bias.to(DEV) if with_bias else None
    q, s = E8.quantize_int8_convrot(W, 64)
    _bits(C.convrot_int8_linear(x.to(DEV), q.to(DEV), s.to(DEV), bd, 64, block_k=64), E8.int8_linear(x, q, s, bias, True, 64))
    qw, sw = E4.quantize_w4a4_weight(W, 16)
    for ld in ('int4', 'int8'):
        _bits(C.w4a4_linear(x.to(DEV), qw.to(DEV), sw.to(DEV), bd, 16, ld, block_k=64), E4.w4a4_linear(x, qw, sw, bias, 16, ld), ld)
    _bits(C.w4a4_linear(x.to(DEV), qw.to(DEV), sw.to(DEV), bd, 16, 'int4', exact=True),
          E4.w4a4_linear(x, qw, sw, bias, 16, 'int4', exact=True), 'exact')
    for ld in ('int4', 'int8'):                               # tl.dot activation rotation (the GPU default)
        y = C.w4a4_linear(x.to(DEV), qw.to(DEV), sw.to(DEV), bd, 16, ld, rotation='dot')
        _bits(y, E4.w4a4_linear(x, qw, sw, bias, 16, ld), 'dot ' + ld)
    y = C.convrot_int8_linear(x.to(DEV), q.to(DEV), s.to(DEV), bd, 64, rotation='dot')
    _bits(y, E8.int8_linear(x, q, s, bias, True, 64), 'dot int8')


@pytest.mark.filterwarnings('ignore:overflow encountered in cast:RuntimeWarning')
def test_w4a4_int4_fp16_overflow():
    "Kitchen's int4 order rounds the integer sum to fp16: beyond 65504 it is inf, as eager."
    r = torch.randn(1, 2048, generator=_gen(23)).sign()       # rotated values +-1: every code is +-7
    x = rotate(r, 16)
    X, W = torch.cat([x, -x]).half(), x.expand(3, -1).half()
    qw, sw = E4.quantize_w4a4_weight(W, 16)
    y, ye = C.w4a4_linear(X.to(DEV), qw.to(DEV), sw.to(DEV), None, 16), E4.w4a4_linear(X, qw, sw, None, 16)
    _bits(y, ye)
    assert torch.isinf(ye).all()                              # 49 * 2048 > 65504


@pytest.mark.parametrize('dtype', DTYPES)
def test_linears_equal_eager_of_rotate_ordered(dtype):
    "On ordinary activations the linears are the eager tails (quantize, integer GEMM, rescale) of rotate_ordered(x)."
    g = _gen(13)
    G = 256
    x = torch.randn(6, 512, generator=g).to(dtype)
    W = _gauss((40, 512), g)
    bias = torch.randn(40, generator=g)
    xr = C.rotate_ordered(x, G)
    q, s = E8.quantize_int8_convrot(W, G)
    _bits(C.convrot_int8_linear(x.to(DEV), q.to(DEV), s.to(DEV), bias.to(DEV), G), E8.int8_linear(xr, q, s, bias))
    qw, sw = E4.quantize_w4a4_weight(W, G)
    wq = unpack_int4(qw)
    _bits(C.w4a4_linear(x.to(DEV), qw.to(DEV), sw.to(DEV), bias.to(DEV), G, 'int8'), E8.int8_linear(xr, wq, sw, bias), 'int8')
    xq, xs = E4.quantize_rows_int4(xr)                        # kitchen's eager int4 order, on xr
    ref = (torch.mm(xq.to(dtype), wq.to(dtype).t()) * xs) * sw.to(dtype) + bias.to(dtype)
    _bits(C.w4a4_linear(x.to(DEV), qw.to(DEV), sw.to(DEV), bias.to(DEV), G, 'int4'), ref, 'int4')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('layout,kw', [(Int8Layout, dict(convrot=True, convrot_groupsize=64)), (Int8Layout, dict(convrot=True)),
                                       (W4A4Layout, dict(convrot_groupsize=16)), (W4A4Layout, dict(linear_dtype='int8'))])
def test_fast_paths_bits(dtype, layout, kw, monkeypatch):
    """Every FAST_PATHS fn gives the classmethod's bits (exact-rotation weights; fp16 rows on the Layout's fp32 rule),
    the classmethod's rotations taken in the kernels' fixed order: dequantizing ordinary scales and rotating bf16
    activations are rounded sums whose order belongs to the CPU's GEMM (it differs under ATEN_CPU_CAPABILITY=default)."""
    for mod in (E8, E4): monkeypatch.setattr(mod, 'rotate', lambda x, g, dtype=None, as_weight=False: C.rotate_ordered(x, g, dtype))
    paths = {op: (fn, fits) for L, op, fn, fits in C.FAST_PATHS if L is layout}
    g = _gen(17)
    W = _grid((24, 256), g, 64)
    W[-3:] *= 2.0 ** -10
    x = _grid((2, 5, 256), g, 64).to(dtype)
    w = W.to(dtype)
    fq, okq = paths['quantize']
    assert okq(w, 0, **kw)
    (q, p), (qe, pe) = fq(w.to(DEV), 0, **kw), layout.quantize(w, 0, **kw)
    _bits(q, qe); _bits(p.scale, pe.scale)
    assert type(p) is type(pe) and {k: v for k, v in vars(p).items() if k != 'scale'} == {k: v for k, v in vars(pe).items() if k != 'scale'}
    pd = type(pe)(**{k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in vars(pe).items()})
    fd, okd = paths['dequantize']
    assert okd(qe.to(DEV), pd, dtype)
    _bits(fd(qe.to(DEV), pd, dtype), layout.dequantize(qe, pe, dtype))
    fl, okl = paths['linear']
    bias = torch.randn(24, generator=g).to(dtype)
    assert okl(x.to(DEV), qe.to(DEV), pd, bias.to(DEV))
    _bits(fl(x.to(DEV), qe.to(DEV), pd, bias.to(DEV)), layout.linear(x, qe, pe, bias))


def test_fast_path_fits():
    paths = {(L, op): fits for L, op, fn, fits in C.FAST_PATHS}
    w = torch.zeros(8, 256)
    fq = paths[Int8Layout, 'quantize']
    assert fq(w, 0, convrot=True) and fq(w, 0, convrot=True, convrot_groupsize=4)
    assert not fq(w, 0, convrot=False) and not fq(w, 0, per_row=True)            # plain INT8 belongs to kernels.int8
    assert not fq(w, 5, convrot=True)                                            # stochastic rounding
    assert not fq(w.double(), 0, convrot=True) and not fq(w[0], 0, convrot=True)
    assert not fq(torch.zeros(8, 96), 0, convrot=True, convrot_groupsize=64) and not fq(w, 0, convrot=True, convrot_groupsize=8)
    q, p = Int8Layout.quantize(w, convrot=True)
    assert paths[Int8Layout, 'dequantize'](q, p, torch.bfloat16) and not paths[Int8Layout, 'dequantize'](q, p, torch.float64)
    qp, pp = Int8Layout.quantize(w, per_row=True)
    assert not paths[Int8Layout, 'dequantize'](qp, pp, torch.float32) and not paths[Int8Layout, 'linear'](torch.zeros(2, 256), qp, pp)
    fl = paths[Int8Layout, 'linear']
    assert fl(torch.zeros(2, 3, 256), q, p) and fl(torch.zeros(2, 256), q, p, torch.zeros(8))
    assert not fl(torch.zeros(2, 128), q, p) and not fl(torch.zeros(2, 256), q, p, torch.zeros(7))
    assert not fl(torch.zeros(2, 256, dtype=torch.float64), q, p)
    fq4 = paths[W4A4Layout, 'quantize']
    assert fq4(w, 0) and fq4(w, 0, convrot_groupsize=64, linear_dtype='int8')
    assert not fq4(w, 1) and not fq4(torch.zeros(8, 96), 0, convrot_groupsize=16) and not fq4(torch.zeros(8, 64), 0)
    q4, p4 = W4A4Layout.quantize(w)
    assert paths[W4A4Layout, 'dequantize'](q4, p4, torch.float16)
    fl4 = paths[W4A4Layout, 'linear']
    assert fl4(torch.zeros(3, 256).half(), q4, p4) and not fl4(torch.zeros(3, 128), q4, p4)
    bad = type(p4)(**{**vars(p4), 'linear_dtype': 'fp8'})
    assert not fl4(torch.zeros(3, 256), q4, bad)


def test_empty_and_errors():
    q, s = C.quantize_int8_convrot(torch.zeros(0, 64).to(DEV), 16)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    assert C.convrot_int8_linear(torch.zeros(0, 64).to(DEV), torch.zeros(4, 64, dtype=torch.int8).to(DEV), torch.ones(4).to(DEV), None, 16).shape == (0, 4)
    with pytest.raises(ValueError, match='power of 4'):
        C.quantize_int8_convrot(torch.zeros(4, 96), 64)
    with pytest.raises(ValueError, match='power of 4'):
        C.dequantize_w4a4_weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4), 8)
    with pytest.raises(ValueError, match='K % 64'):
        C.quantize_w4a4_weight(torch.zeros(4, 48), 16)
    with pytest.raises(ValueError, match='rotation'):
        C.quantize_int8_convrot(torch.zeros(4, 64), 16, rotation='fast')
    with pytest.raises(ValueError, match='float32, float16 or bfloat16'):
        C.quantize_int8_convrot(torch.zeros(4, 64, dtype=torch.float64), 16)
    with pytest.raises(ValueError, match='linear_dtype'):
        C.w4a4_linear(torch.zeros(2, 64), torch.zeros(3, 32, dtype=torch.int8), torch.ones(3), None, 16, 'fp8')
    with pytest.raises(ValueError, match='K/2 bytes'):
        C.w4a4_linear(torch.zeros(2, 64), torch.zeros(3, 16, dtype=torch.int8), torch.ones(3), None, 16)
    with pytest.raises(ValueError, match='weight scale'):
        C.convrot_int8_linear(torch.zeros(2, 64), torch.zeros(3, 64, dtype=torch.int8), torch.ones(2), None, 16)
    with pytest.raises(ValueError, match='w4a4_mm'):
        C.w4a4_mm(torch.zeros(2, 64, dtype=torch.int8), torch.zeros(3, 16, dtype=torch.int8))


def _cuda_eager_rows(xr):
    """The eager INT8 and int4 row quantizers (`quantize_rows_int8`, `quantize_rows_int4`) as torch computes them on CUDA:
    the divisions by the Python numbers 127 and 7 are multiplications by fp32(1/127) and fp32(1/7)."""
    a = xr.abs().amax(-1, keepdim=True)
    s8 = (a.float() * torch.tensor(recip32(127.0))).clamp_(min=1e-30)
    d = s8.to(xr.dtype)
    d = d.masked_fill(d == 0, torch.finfo(xr.dtype).tiny)
    q8 = (xr / d).round_().clamp_(-128.0, 127.0).to(torch.int8)
    s4 = (a.clamp(min=1e-10).float() * torch.tensor(recip32(7.0))).to(xr.dtype)
    v = (xr / s4).round_().clamp_(-7.0, 7.0)
    if xr.dtype == torch.float16: v = v.nan_to_num_(0.0)
    return q8, s8, v.to(torch.int8), s4.float()


@pytest.mark.parametrize('dtype', DTYPES)
def test_quantize_cuda_division_variant(dtype):
    "cuda_div=True follows torch's CUDA arithmetic (checked on the kernels' own rotation order); fp32 scales differ from the CPU division."
    g = _gen(21)
    x = (_gauss((128, 64), g) * torch.rand(128, 1, generator=g) * 100).to(dtype)
    x[0] = 0.0
    q8, s8, q4, s4 = _cuda_eager_rows(C.rotate_ordered(x, 16))
    q, s = C._convrot_quant(x.to(DEV), 16, 0, cuda_div=True)
    _bits(q, q8, 'int8 codes'); _bits(s, s8.reshape(-1), 'int8 scales')
    q, s = C._convrot_quant(x.to(DEV), 16, 1, cuda_div=True)
    _bits(q, q4, 'int4 codes'); _bits(s, s4.reshape(-1), 'int4 scales')
    if dtype == torch.float32:                  # about 4% of the /127 scales and half of the /7 ones differ
        assert (s8.reshape(-1) != C._convrot_quant(x.to(DEV), 16, 0, cuda_div=False)[1].cpu()).any()
        assert (s4.reshape(-1) != C._convrot_quant(x.to(DEV), 16, 1, cuda_div=False)[1].cpu()).any()


_AOT = r'''
import inspect, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import cquant.kernels.convrot as C
from cquant.kernels.base import KIND_TINY
names = list(inspect.signature(C._convrot_quant_kernel.fn).parameters)
ptrs = dict(x_ptr='*bf16', h_ptr='*fp32', q_ptr='*i8', s_ptr='*fp32', M='i32', K='i32', FLOOR='fp32')
for mode, pack in [(0, False), (1, True)]:
    KC, NGT, BJ, bm = C._tiles(256, 3072, 4096, 'dot')
    consts = dict(G=256, KC=KC, NGT=NGT, BJ=BJ, BLOCK_M=bm, KIND=2, MODE=mode, PACK=pack, FIX16=False,
                  TINY=KIND_TINY[2], ROT=1, INTERP=False, CUDA_DIV=True)
    sig = {n: 'constexpr' if n in consts else ptrs[n] for n in names}
    src = ASTSource(C._convrot_quant_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget('cuda', int(sys.argv[1]), 32), options={'enable_fp_fusion': False})
    print(mode, 'ok', k.metadata.shared)
'''


@pytest.mark.long
def test_activation_rotation_fits_shared_memory(compile_offline):
    """The activation quantizer of both rotated linears with `tl.dot` (G = 256, bf16, the largest row block) compiles
    for sm_89 within its shared memory: unrolled, its chunks needed over 500 KiB, more than even an H200 has (227 KiB: it failed there)."""
    from test_kernels_lowbit import SHARED_SM89
    out = compile_offline(_AOT, '89')
    shared = [int(l.split()[2]) for l in out.splitlines() if ' ok ' in l]
    assert len(shared) == 2 and max(shared) <= SHARED_SM89, out
