"""Triton NVFP4 / MXFP8 kernels vs the eager reference (`cquant.nvfp4`, `cquant.mxfp8`), on CPU through Triton's interpreter.

Quantize and dequantize are compared bit for bit; the dequant-fused linears within the elementwise bound
`cquant.kernels.blockscaled.linear_tolerance` (derived in nbs/32_kernels_blockscaled.ipynb). The quantizers follow
the eager arithmetic of their device (`cuda_div`): the CUDA one is emulated on CPU by `_on_cuda`.
TRITON_INTERPRET must be set before `@triton.jit` runs (tests/conftest.py does it; repeated here for
running this file alone). Skipped when triton is not installed.
"""
import math
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

import numpy as np
from cquant import nvfp4 as RN, mxfp8 as RM
from cquant.nvfp4 import NVFP4Layout
from cquant.mxfp8 import MXFP8Layout
from cquant.numerics import to_blocked, pad_to_multiple
from cquant.tensor import test_bits as check_bits, layout_op, register_fast_path, remove_fast_paths
import cquant.kernels.blockscaled as B
from cquant.kernels.base import recip32

# Triton's interpreter on CPU: the full tier; the quick tier checks each kernel in its notebook (nbs/3N_kernels_*)
pytestmark = pytest.mark.long

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def _dev(t): return t.to(DEV) if isinstance(t, torch.Tensor) else t
def _cpu(t): return t.cpu() if isinstance(t, torch.Tensor) else t


def _on_cuda(fn, *args, **kw):
    """(fn(*args, **kw), divisors met), run with torch's CUDA rule for `float tensor / Python number`: a multiplication
    by fp32(1/D) in fp32, rounded to the tensor's dtype (a correctly rounded division on CPU)."""
    seen, div, own = [], torch.Tensor.__truediv__, torch.Tensor.__dict__.get('__truediv__')
    def truediv(a, b):
        if isinstance(b, (int, float)) and not isinstance(b, bool) and a.dtype in DTYPES:
            seen.append(b)
            return (a.float() * torch.tensor(recip32(b))).to(a.dtype)
        return div(a, b)
    torch.Tensor.__truediv__ = truediv
    try:
        return fn(*args, **kw), seen
    finally:
        if own is None: del torch.Tensor.__truediv__
        else: torch.Tensor.__truediv__ = own


def _ref(fn, *args, cuda=DEV == 'cuda'):
    "Eager `fn` with the arithmetic the kernels use by default on DEV (CPU division, or CUDA's emulated)."
    return _on_cuda(fn, *args)[0] if cuda else fn(*args)


def _weight(shape, dtype, seed=0, lo=-5, hi=1):
    "Rows over several orders of magnitude, a zero block, -0.0, E2M1 ties in the last row."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 10.0 ** torch.empty(shape[0], 1).uniform_(lo, hi, generator=g)
    if shape[1] >= 16:
        w[0, :16] = 0; w[0, 1] = -0.0
        w[-1, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * torch.tensor([1.0, -1.0] * 4)
        w[-1, 8:16] = 0.0; w[-1, 15] = 6.0
    return w.to(dtype)


def _same(got, ref, what):
    for a, b, name in zip(got, ref, ('qdata', 'scale 1', 'scale 2')): check_bits(_cpu(a), b, f'{what} {name}')


# ---------------------------------------------------------------- NVFP4 quantize
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(1, 1), (33, 50), (129, 130), (16, 64)])
@pytest.mark.parametrize('scale', [None, 1e-4])
def test_nvfp4_quantize_bit_exact(dtype, shape, scale):
    w = _weight(shape, dtype, seed=shape[0])
    tiles = {'block_r': 64, 'block_b': 4} if shape == (129, 130) and scale is None else {}   # several programs per tensor
    _same(B.nvfp4_quantize(_dev(w), scale, **tiles), _ref(RN.nvfp4_quantize, w, scale), f'{dtype} {shape} {scale}')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.filterwarnings('ignore::RuntimeWarning')      # the interpreter's numpy: 0/0 and x/0 in discarded lanes
def test_nvfp4_quantize_edge_values(dtype):
    "Zero tensor, huge and tiny tensors (fp16 global-scale underflow guard, bf16/fp32 subnormals), odd given scales."
    fi = torch.finfo(dtype)
    cases = {'zeros': torch.zeros(20, 40), 'huge': torch.linspace(-1, 1, 800).reshape(20, 40) * float(fi.max),
             'tiny': torch.linspace(-1, 1, 800).reshape(20, 40) * float(fi.tiny) * 4,
             'subnormal': torch.full((20, 40), float(fi.tiny) / 4).to(dtype).float(),
             'fp16 underflow': torch.linspace(-1, 1, 800).reshape(20, 40) * 5e-5}
    cases['mixed'] = torch.cat([cases['huge'][:10], cases['tiny'][:10]])
    ties = [0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, -6.0, 0.5, 1.0, 1.5, 3.0, 4.0, -0.0, 5.5, 5.9]   # exact ties when s*b = 1
    cases['ties'] = torch.tensor(ties).repeat(20, 3)[:, :40]
    for name, w in cases.items():                                 # dynamic global scale: per tensor
        w = w.to(dtype)
        _same(B.nvfp4_quantize(_dev(w)), _ref(RN.nvfp4_quantize, w), f'{dtype} {name}')
    w = torch.cat(list(cases.values())).to(dtype)                 # given scales: all cases in one tensor
    for scale in (1e-30, 1.0, 3.0, 1e30):                       # 1.0: the tie blocks get b = 1, s*b = 1
        _same(B.nvfp4_quantize(_dev(w), scale), _ref(RN.nvfp4_quantize, w, scale), f'{dtype} scale={scale}')


def test_nvfp4_quantize_noncontiguous_and_tensor_scale():
    w = _weight((48, 64), torch.bfloat16).t()                   # a transposed view
    _same(B.nvfp4_quantize(_dev(w)), _ref(RN.nvfp4_quantize, w), 'transposed view')
    s = torch.tensor([2.5e-3], dtype=torch.float64)              # a tensor global scale: value-cast to fp32
    _same(B.nvfp4_quantize(_dev(w), _dev(s)), _ref(RN.nvfp4_quantize, w, s), 'tensor scale')


# ---------------------------------------------------------------- MXFP8 quantize
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(1, 1), (33, 50), (129, 130), (64, 96)])
def test_mxfp8_quantize_bit_exact(dtype, shape):
    w = _weight(shape, dtype, seed=shape[1], lo=-6, hi=3)
    tiles = {'block_r': 64, 'block_b': 2} if shape == (129, 130) else {}
    _same(B.quantize_mxfp8(_dev(w), **tiles), _ref(RM.quantize_mxfp8, w), f'{dtype} {shape}')


@pytest.mark.parametrize('cuda_div', [False, True])
def test_mxfp8_exponent_rule(cuda_div):
    """Block maxima just above 448*2^k (where the fp32 log2 rounds to an integer), over the whole fp32 range, subnormals
    included; with either quotient (CPU division, CUDA's times fp32(1/448)) and the CPU log2 rule (CUDA's is unverified)."""
    ks, js = torch.arange(-140, 120, dtype=torch.float64), torch.arange(0, 28, dtype=torch.float64)   # J(u) <= 23
    amax = (448.0 * 2.0 ** ks[:, None] * (1 + js[None, :] * 2.0 ** -23)).float().reshape(-1, 1)
    amax = torch.cat([amax, torch.nextafter(amax, torch.tensor(math.inf))])
    x = torch.cat([amax, amax * torch.linspace(-1, 1, 31)[None, :]], dim=1).reshape(-1, 8 * 32)   # 8 blocks per row
    q, e = B.quantize_mxfp8(_dev(x), cuda_div=cuda_div)
    qr, er = _ref(RM.quantize_mxfp8, x, cuda=cuda_div)
    check_bits(_cpu(e), er, 'exponents'); check_bits(_cpu(q), qr, 'elements')
    if cuda_div: assert (er.view(torch.uint8) != RM.quantize_mxfp8(x)[1].view(torch.uint8)).any()   # the quotients part


@pytest.mark.parametrize('dtype', DTYPES)
def test_mxfp8_quantize_edge_values(dtype):
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(3)
    r = torch.randn(8, 64, generator=g)
    for name, w in {'zeros': torch.zeros(8, 64), 'huge': r / r.abs().max() * float(fi.max),
                    'tiny': r * float(fi.tiny), 'subnormal': r * float(fi.tiny) / 64,
                    'clamp': torch.tensor([0.5, 1.0625, 1.1875, 3.5 * 2 ** -9, 448.0, 464.0, -0.0, 15 * 2 ** -10] * 8).reshape(2, 32),
                    'ties': torch.tensor([448.0, 1.0625, 1.1875, 3.5 * 2 ** -9, -2.5 * 2 ** -9, 15 * 2 ** -10, 2.0 ** -10, 1.5 * 2 ** -9,
                                          232.0, -0.0, 2.0 ** -11, -5 * 2 ** -4, 9 * 2 ** -4, 13 * 2 ** -8, 17.0, 19.0] * 4).reshape(2, 32)}.items():
        w = w.to(dtype)
        _same(B.quantize_mxfp8(_dev(w)), _ref(RM.quantize_mxfp8, w), f'{dtype} {name}')


# ---------------------------------------------------------------- CPU or CUDA division
def _division_cases():
    "fp32 tensors whose scales part between the CPU and the CUDA division (checked in fp32), and edge cases."
    mid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    af = (3 * (mid[1:] + mid[:-1]).double()).float()             # 6 x the e4m3 rounding midpoints
    af = torch.cat([af, torch.nextafter(af, torch.tensor(0.0)), torch.nextafter(af, torch.tensor(1e9))])
    ex = torch.tensor([7.000000953674316, 14.000001907348633, 7.0, 448.0])   # fl(a/448) = 2^k, fl(a * fp32(1/448)) above
    return {'amax 0.7': torch.linspace(-1, 1, 2048).reshape(32, 64) * 0.7,   # nvfp4 global scale
            'block maxima': (af[:, None] * torch.linspace(1, -1, 16)).reshape(-1, 96),   # nvfp4 block scales at s = 1
            'mxfp8 exponents': (ex[:, None] * torch.linspace(1, -1, 32)).reshape(2, 64),
            'weight': _weight((33, 50), torch.float32, seed=4),
            'fp16 underflow': torch.linspace(-1, 1, 800).reshape(20, 40) * 5e-5, 'zeros': torch.zeros(3, 40)}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.filterwarnings('ignore::RuntimeWarning')
def test_nvfp4_quantize_cuda_division(dtype):
    "cuda_div=False: the eager bits on CPU; True: eager with CUDA's `/ 2688` and `/ 6` (every Python-number division it does)."
    for name, w in _division_cases().items():
        w = w.to(dtype)
        for scale in (None, 1.0) if name in ('block maxima', 'weight') else (None,):
            cuda, seen = _on_cuda(RN.nvfp4_quantize, w, scale)
            assert set(seen) == ({2688.0, 6.0} if scale is None else {6.0}), seen
            cpu = RN.nvfp4_quantize(w, scale)
            _same(B.nvfp4_quantize(_dev(w), scale, cuda_div=True), cuda, f'{dtype} {name} {scale} cuda')
            _same(B.nvfp4_quantize(_dev(w), scale, cuda_div=False), cpu, f'{dtype} {name} {scale} cpu')
            if dtype == torch.float32 and name == 'amax 0.7' and scale is None: assert cpu[1] != cuda[1]
            if dtype == torch.float32 and name == 'block maxima' and scale == 1.0:
                assert int((cpu[2].view(torch.uint8) != cuda[2].view(torch.uint8)).sum()) == 15


@pytest.mark.parametrize('dtype', DTYPES)
def test_mxfp8_quantize_cuda_division(dtype):
    "cuda_div=False: the eager bits on CPU; True: eager with CUDA's `/ 448` (then the CPU log2 rule; CUDA's is unverified)."
    for name, w in _division_cases().items():
        w = w.to(dtype)
        cuda, seen = _on_cuda(RM.quantize_mxfp8, w)
        assert set(seen) == {448.0}, seen
        cpu = RM.quantize_mxfp8(w)
        _same(B.quantize_mxfp8(_dev(w), cuda_div=True), cuda, f'{dtype} {name} cuda')
        _same(B.quantize_mxfp8(_dev(w), cuda_div=False), cpu, f'{dtype} {name} cpu')
        if dtype == torch.float32 and name == 'mxfp8 exponents':
            assert int((cpu[1].view(torch.uint8) != cuda[1].view(torch.uint8)).sum()) == 2


# ---------------------------------------------------------------- dequantize
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('scale', [None, 1e-9, 1e5])
def test_nvfp4_dequantize_bit_exact(dtype, scale):
    "Every output dtype, cropped and padded, global scales under fp16's normal range and above its max."
    for shape in [(33, 50), (129, 130)]:
        q, s, bs = RN.nvfp4_quantize(_weight(shape, torch.float32), scale)
        for crop in (shape, None) if shape == (33, 50) else (shape,):
            with np.errstate(over='ignore', invalid='ignore'):
                got = B.nvfp4_dequantize(_dev(q), _dev(s), _dev(bs), dtype, crop)
            check_bits(_cpu(got), RN.nvfp4_dequantize(q, s, bs, dtype, crop), f'{dtype} {shape} {scale} {crop}')


def test_nvfp4_dequantize_every_code():
    "All 256 bytes of qdata with all 256 e4m3 block-scale bytes (NaN 0x7F/0xFF included)."
    q = torch.arange(256 * 8).remainder(256).to(torch.uint8).reshape(256, 8)     # K = 16: one block per row
    bs = to_blocked(torch.arange(256, dtype=torch.uint8).reshape(256, 1).view(torch.float8_e4m3fn))   # row r: scale byte r
    for dtype in DTYPES:
        for s in (torch.tensor(0.37), torch.tensor(3e-6)):
            with np.errstate(over='ignore', invalid='ignore'):
                got = _cpu(B.nvfp4_dequantize(_dev(q), _dev(s), _dev(bs), dtype))
            ref = RN.nvfp4_dequantize(q, s, bs, dtype)
            nan = torch.isnan(ref)
            assert torch.equal(torch.isnan(got), nan)
            check_bits(got[~nan], ref[~nan], f'{dtype} {float(s)}')


@pytest.mark.parametrize('dtype', DTYPES)
def test_mxfp8_dequantize_bit_exact(dtype):
    for shape, scale in [((33, 50), 1.0), ((129, 130), 1.0), ((40, 64), 1e-36)]:   # 1e-36: exponents near 0 (subnormal products)
        q, e = RM.quantize_mxfp8(_weight(shape, torch.float32, lo=-6, hi=3) * scale)
        for crop in (shape, None):
            check_bits(_cpu(B.dequantize_mxfp8(_dev(q), _dev(e), dtype, crop)), RM.dequantize_mxfp8(q, e, dtype, crop), f'{dtype} {shape} {crop}')


def test_mxfp8_dequantize_every_code():
    "All 256 e4m3 bytes with every E8M0 byte (0 decodes to 0.0, 255 to NaN)."
    q = torch.arange(256).to(torch.uint8).repeat(256, 1).view(torch.float8_e4m3fn)   # every byte in every row
    bs = to_blocked(torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 8)).view(torch.float8_e8m0fnu)   # row r: exponent r
    for dtype in DTYPES:
        with np.errstate(over='ignore', invalid='ignore'):
            got = _cpu(B.dequantize_mxfp8(_dev(q), _dev(bs), dtype))
        ref = RM.dequantize_mxfp8(q, bs, dtype)
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(got), nan)
        check_bits(got[~nan], ref[~nan], str(dtype))


# ---------------------------------------------------------------- linears
def _linear_case(kind, dtype, M, N, K, bias, input_scale=None, seed=0, x=None, **kw):
    "Kernel linear vs the eager one (CPU or emulated-CUDA arithmetic, as `cuda_div` or DEV say), within the bound."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    x = (torch.randn(M, K, generator=g) * 2).to(dtype) if x is None else x
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    cuda = DEV == 'cuda' if kw.get('cuda_div') is None else kw['cuda_div']
    if kind == 'nvfp4':
        q, s, bs = RN.nvfp4_quantize(w)
        y = B.nvfp4_linear(_dev(x), _dev(q), _dev(s), _dev(bs), (N, K), _dev(b), _dev(input_scale), **kw)
        y_ref = _ref(RN.nvfp4_linear, x, q, s, bs, (N, K), b, input_scale, cuda=cuda)
        xq, xs, xbs = _ref(RN.nvfp4_quantize, x, input_scale, cuda=cuda)
        xd, wd = RN.nvfp4_dequantize(xq, xs, xbs, torch.float32, (M, K)), RN.nvfp4_dequantize(q, s, bs, torch.float32, (N, K))
    else:
        q, e = RM.quantize_mxfp8(w)
        y = B.mxfp8_linear(_dev(x), _dev(q), _dev(e), (N, K), _dev(b), **kw)
        y_ref = _ref(RM.mxfp8_linear, x, q, e, (N, K), b, cuda=cuda)
        xd = RM.dequantize_mxfp8(*_ref(RM.quantize_mxfp8, x, cuda=cuda), torch.float32, (M, K))
        wd = RM.dequantize_mxfp8(q, e, torch.float32, (N, K))
    y = _cpu(y)
    assert y.dtype == y_ref.dtype == dtype and y.shape == y_ref.shape
    tol = B.linear_tolerance(xd, wd, b, y_ref, dtype)
    err = (y.double() - y_ref.double()).abs()
    assert bool((err <= tol).all()), f'{kind} {dtype}: error exceeds the bound by {float((err - tol).max())}'
    return y, y_ref


@pytest.mark.parametrize('kind', ['nvfp4', 'mxfp8'])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('bias', [True, False])
def test_linear_within_bound(kind, dtype, bias):
    _linear_case(kind, dtype, 5, 33, 96, bias, block_k=32)      # ragged M, N; K over three tiles


@pytest.mark.parametrize('kind', ['nvfp4', 'mxfp8'])
def test_linear_autotuned_larger(kind):
    "The autotuned launch (first config when interpreting), M and N over several tiles, K not a multiple of 32."
    _linear_case(kind, torch.bfloat16, 70, 90, 200, True, seed=1)


def test_nvfp4_linear_calibrated_input_scale():
    for s in (2e-3, torch.tensor(5e-4), 1e-6):                   # 1e-6: block scales clamp at 448, elements saturate
        _linear_case('nvfp4', torch.float16, 4, 20, 48, True, input_scale=s)


@pytest.mark.parametrize('kind,operand', [('nvfp4', torch.bfloat16), ('nvfp4', torch.float32), ('mxfp8', torch.float32),
                                          ('mxfp8', torch.float16)])
def test_linear_operand_dtypes(kind, operand):
    "Exact operands (nvfp4 in bf16 and fp32, mxfp8 in fp32) and mxfp8 in fp16 (exact here: block exponents in 112..134)."
    _linear_case(kind, torch.float32, 6, 24, 64, True, operand_dtype=operand)


def _eager_activation(kind):
    "`B._linear`'s activation quantizer, from the eager code run with CUDA's division (the GEMM then gets eager-on-CUDA's bytes)."
    def nvfp4(x2):
        q, s, bs = _on_cuda(RN.nvfp4_quantize, x2)[0]
        return q, bs.view(torch.uint8), s
    def mxfp8(x2):
        q, e = _on_cuda(RM.mxfp8_encode_blocks, pad_to_multiple(x2, 1, 32))[0]
        return q.view(torch.uint8), to_blocked(e), None
    return nvfp4 if kind == 'nvfp4' else mxfp8


@pytest.mark.parametrize('kind', ['nvfp4', 'mxfp8'])
@pytest.mark.parametrize('dtype', DTYPES)
def test_linear_cuda_division(kind, dtype):
    """cuda_div=True: the activation quantized as eager on CUDA (the bits of the same GEMM fed that activation), within the
    bound of the emulated eager-on-CUDA linear; fp32 activations chosen so that it differs from cuda_div=False."""
    g = torch.Generator().manual_seed(9)
    M, N, K = 5, 24, 96
    x = torch.rand(M, K, generator=g) * 1.4 - 0.7
    x[0, 0] = 0.7                                              # nvfp4: amax 0.7, the global scales part
    if kind == 'mxfp8': x[1, :2] = torch.tensor([7.000000953674316, 3.3e-4])   # exponent 121 on CPU, 122 on CUDA: 3.3e-4 -> 11 or 5 e4m3 subnormal steps
    x = x.to(dtype)
    w, b = torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g).to(dtype)
    if kind == 'nvfp4':
        q, s, bs = RN.nvfp4_quantize(w)
        lin = lambda cd: B.nvfp4_linear(_dev(x), _dev(q), _dev(s), _dev(bs), (N, K), _dev(b), cuda_div=cd, block_k=32)
        ref = B._linear(0, _dev(x), _dev(q), _dev(bs), (N, K), _dev(s), _eager_activation(kind), _dev(b), torch.float16, (None, None, 32))
    else:
        q, e = RM.quantize_mxfp8(w)
        lin = lambda cd: B.mxfp8_linear(_dev(x), _dev(q), _dev(e), (N, K), _dev(b), cuda_div=cd, block_k=32)
        ref = B._linear(1, _dev(x), _dev(q), _dev(e), (N, K), None, _eager_activation(kind), _dev(b), torch.bfloat16, (None, None, 32))
    y = lin(True)
    check_bits(_cpu(y), _cpu(ref), f'{kind} {dtype}')
    if dtype == torch.float32: assert not torch.equal(_cpu(y), _cpu(lin(False)))
    _linear_case(kind, dtype, M, N, K, True, x=x, seed=9, cuda_div=True, block_k=32)


def test_linear_3d_input_and_errors():
    x = torch.randn(2, 3, 40)
    q, s, bs = RN.nvfp4_quantize(torch.randn(17, 40))
    y = _cpu(B.nvfp4_linear(_dev(x), _dev(q), _dev(s), _dev(bs), (17, 40)))
    assert y.shape == (2, 3, 17)
    torch.testing.assert_close(y, RN.nvfp4_linear(x, q, s, bs, (17, 40)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match='features'): B.nvfp4_linear(_dev(x), _dev(q), _dev(s), _dev(bs), (17, 41))
    with pytest.raises(ValueError, match='storage'): B.nvfp4_linear(_dev(x), _dev(q[:16]), _dev(s), _dev(bs), (17, 40))
    with pytest.raises(ValueError, match='operand_dtype'):
        B.nvfp4_linear(_dev(x), _dev(q), _dev(s), _dev(bs), (17, 40), operand_dtype=torch.float64)


# ---------------------------------------------------------------- FAST_PATHS
def _args(layout, op, w, x):
    qd, p = layout.quantize(w)
    return {'quantize': ((w,), {}), 'dequantize': ((qd, p, torch.bfloat16), {}),
            'linear': ((x, qd, p), {'bias': torch.randn(p.orig_shape[0])})}[op]


@pytest.mark.parametrize('entry', B.FAST_PATHS, ids=lambda e: f'{e[0].__name__}.{e[1]}')
def test_fast_path_entries(entry):
    "Each entry, called directly and through `layout_op` once registered, gives the classmethod's result."
    layout, op, fn, fits = entry
    w = _weight((40, 72), torch.float16)
    x = torch.randn(3, 72).to(torch.float16)
    args, kw = _args(layout, op, w, x)
    assert fits(*args, **kw)
    ref = getattr(layout, op)(*args, **kw)
    register_fast_path(layout, op, fn, fits)
    try:
        outs = [fn(*args, **kw), layout_op(layout, op, *args, **kw)]
    finally:
        remove_fast_paths([fn])
    for got in outs:
        if op == 'quantize':
            check_bits(got[0], ref[0], 'qdata')
            assert type(got[1]) is type(ref[1]) and got[1].orig_shape == ref[1].orig_shape and got[1].orig_dtype == ref[1].orig_dtype
            for k, v in ref[1].tensors().items(): check_bits(getattr(got[1], k), v, k)
        elif op == 'dequantize':
            check_bits(got, ref, op)
        else:
            assert got.dtype == ref.dtype and got.shape == ref.shape
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-3)


def test_fast_path_scale_option_and_fits():
    w = _weight((40, 72), torch.bfloat16)
    got, ref = B._quantize_nvfp4(w, scale=2e-4), NVFP4Layout.quantize(w, scale=2e-4)
    check_bits(got[0], ref[0], 'qdata'); check_bits(got[1].block_scale, ref[1].block_scale, 'block scale')
    check_bits(got[1].global_scale, ref[1].global_scale, 'global scale')
    f = B._fits_quantize_nvfp4
    assert f(w) and f(w, 0, 1e-3) and f(w, scale=2)
    assert not f(w, stochastic_rounding=1) and not f(w, scale=0.0) and not f(w, scale=-1.0) and not f(w, scale=math.nan)
    assert not f(w, scale=math.inf) and not f(w.double()) and not f(w[0]) and not f(w[:0]) and not f(w.to(torch.int32))
    assert B._fits_quantize_mxfp8(w) and not B._fits_quantize_mxfp8(w, stochastic_rounding=7) and not B._fits_quantize_mxfp8(w.double())
    qd, p = NVFP4Layout.quantize(w)
    assert B._fits_dequantize_nvfp4(qd, p, torch.float32) and not B._fits_dequantize_nvfp4(qd, p, torch.float64)
    assert not B._fits_dequantize_nvfp4(qd[:16], p, torch.float32)
    x = torch.randn(3, 72)
    assert B._fits_linear_nvfp4(x, qd, p) and B._fits_linear_nvfp4(x, qd, p, torch.randn(40), torch.tensor(1e-3))
    assert not B._fits_linear_nvfp4(x[:, :70], qd, p) and not B._fits_linear_nvfp4(x.double(), qd, p)
    assert not B._fits_linear_nvfp4(x, qd, p, torch.randn(41)) and not B._fits_linear_nvfp4(x, qd, p, None, torch.ones(2))
    assert not B._fits_linear_nvfp4(x[:0], qd, p)
    qm, pm = MXFP8Layout.quantize(w)
    assert B._fits_dequantize_mxfp8(qm, pm, torch.bfloat16) and B._fits_linear_mxfp8(x, qm, pm, torch.randn(40).half())
    assert not B._fits_linear_mxfp8(x, qm, pm, torch.randn(40).double()) and not B._fits_dequantize_mxfp8(qm[:, :32], pm, torch.float32)
