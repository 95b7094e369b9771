"""The shared Triton primitives of `cquant.kernels.base` against torch and the eager reference, run on CPU through
Triton's interpreter (`tests/conftest.py` sets TRITON_INTERPRET=1 when there is no CUDA GPU)."""
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')
import triton, triton.language as tl

from cquant.int8 import quantize_rows_int8, int8_linear
from cquant.numerics import e2m1_encode, e2m1_decode, E2M1_VALUES
from cquant.tensor import same_bits
import cquant.kernels.base as KB
from cquant.kernels.base import (load_f32, store_as, out_view, div_scalar, rint, recip32, fp8_code, fp8_decode,
                                 e4m3_encode, e2m1_encode as k_e2m1_encode, e2m1_decode as k_e2m1_decode, dot_acc)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def _cpu(t): return t.cpu()


def test_available():
    assert KB.triton_available()


def test_host_helpers():
    assert [KB.float_kind(d) for d in DTYPES] == [0, 2, 1]
    with pytest.raises(ValueError, match='cquant.kernels: expected float32, float16 or bfloat16, got torch.float64'):
        KB.float_kind(torch.float64)
    assert [KB.pow2(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert recip32(127.0) == 0.007874015718698502 and recip32(7.0) == 0.1428571492433548
    t = torch.zeros(3, dtype=torch.bfloat16)
    assert out_view(t).dtype == torch.int16 and out_view(t.float()).dtype == torch.float32
    assert KB.KIND_TINY[2] == torch.finfo(torch.bfloat16).tiny and KB.FLOAT_DTYPES == (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _widen_kernel(x_ptr, o_ptr, n, KIND: tl.constexpr, B: tl.constexpr):
    offs = tl.arange(0, B)
    tl.store(o_ptr + offs, load_f32(x_ptr + offs, offs < n, KIND), mask=offs < n)


@pytest.mark.parametrize('dtype', DTYPES)
def test_load_f32_is_exact(dtype):
    "bf16 subnormals (misread by the interpreter's plain bf16 -> fp32) and every other value widen exactly."
    fi = torch.finfo(dtype)
    x = torch.tensor([1e-39, -2e-39, 9.2e-41, float(fi.tiny), -0.0, 1.0, float(fi.max), float('inf')]).to(dtype)
    out = torch.empty(8, device=DEV)
    _widen_kernel[(1,)](x.to(DEV), out, 8, KB.float_kind(dtype), 8)
    assert same_bits(_cpu(out), x.float())


@triton.jit
def _store_kernel(x_ptr, o_ptr, n, KIND: tl.constexpr, B: tl.constexpr):
    offs = tl.arange(0, B)
    store_as(o_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0), offs < n, KIND)


@pytest.mark.parametrize('dtype', DTYPES)
def test_store_as_rounds_like_torch(dtype):
    "fp32 -> dtype on store, as torch's cast (RNE, ties, overflow to inf); every NaN is the quiet NaN in bf16."
    g = torch.Generator().manual_seed(3)
    bits = torch.cat([torch.randint(-2**31, 2**31 - 1, (200,), generator=g, dtype=torch.int64).to(torch.int32),
                      torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0x00000001, -2**31], dtype=torch.int32)])
    x = bits.view(torch.float32)
    out = torch.empty(x.numel(), dtype=dtype, device=DEV)
    _store_kernel[(1,)](x.to(DEV), out_view(out), x.numel(), KB.float_kind(dtype), 256)
    ref = x.to(dtype)
    nan = ref.isnan()
    assert same_bits(_cpu(out)[~nan], ref[~nan]) and _cpu(out)[nan].isnan().all()
    if dtype == torch.bfloat16:
        nb = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)
        o = torch.empty(3, dtype=dtype, device=DEV)
        _store_kernel[(1,)](nb.to(DEV), out_view(o), 3, 2, 4)
        assert (_cpu(o).view(torch.int16) & 0x7FFF).eq(0x7FC0).all()     # no rounding carry into -0.0 or inf


@triton.jit
def _div_kernel(x_ptr, o_ptr, r_ptr, n, D: tl.constexpr, RD: tl.constexpr, CUDA_DIV: tl.constexpr, B: tl.constexpr):
    offs = tl.arange(0, B)
    v = div_scalar(tl.load(x_ptr + offs, mask=offs < n, other=0.0), D, RD, CUDA_DIV)
    tl.store(o_ptr + offs, v, mask=offs < n)
    tl.store(r_ptr + offs, rint(v), mask=offs < n)


@pytest.mark.parametrize('D', [127.0, 7.0, 448.0])
def test_div_scalar_and_rint(D):
    "CPU division (correctly rounded) or CUDA's product with fp32(1/D); rint rounds half to even (a zero is +0)."
    g = torch.Generator().manual_seed(int(D))
    x = torch.cat([torch.randn(250, generator=g) * 3 * D, torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.0]) * D])
    for cuda_div in (False, True):
        o, r = torch.empty(256, device=DEV), torch.empty(256, device=DEV)
        _div_kernel[(1,)](x.to(DEV), o, r, 256, D, recip32(D), cuda_div, 256)
        ref = x * torch.tensor(recip32(D)) if cuda_div else x / D
        assert same_bits(_cpu(o), ref) and torch.equal(_cpu(r), ref.round())      # rint: -0.4 -> +0, values equal
    assert (x / D != x * torch.tensor(recip32(D))).any()              # the two divisions really differ


@triton.jit
def _fp8_kernel(c_ptr, v_ptr, d_ptr, e_ptr, ev_ptr, n, E5M2: tl.constexpr, B: tl.constexpr):
    offs = tl.arange(0, B)
    m = offs < n
    md = offs < 256                                                 # the 256 bytes to decode
    tl.store(d_ptr + offs, fp8_decode(tl.load(c_ptr + offs, mask=md, other=0), E5M2), mask=md)
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    tl.store(e_ptr + offs, fp8_code(v, E5M2), mask=m)
    if not E5M2:
        c, cv = e4m3_encode(v)
        tl.store(ev_ptr + offs, cv, mask=m)


@pytest.mark.parametrize('fp8', [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_codes(fp8):
    "Every byte decodes to torch's value; every finite value, every tie between neighbours and tiny values encode to torch's byte."
    codes = torch.arange(256, dtype=torch.int32)
    vals = codes.to(torch.uint8).view(fp8).float()
    fin = vals[vals.isfinite()].unique()
    mids = ((fin[1:].double() + fin[:-1].double()) / 2).float()
    fmax = float(torch.finfo(fp8).max)
    probe = torch.cat([fin, mids, torch.tensor([1e-30, -1e-30, fmax * 1.01, -fmax * 3])]).clamp(-fmax, fmax)
    n = probe.numel()
    dec, enc, ev = torch.empty(256, device=DEV), torch.empty(n, dtype=torch.int32, device=DEV), torch.empty(n, device=DEV)
    _fp8_kernel[(1,)](codes.to(DEV), probe.to(DEV), dec, enc, ev, n, fp8 == torch.float8_e5m2, 1024)
    nan = vals.isnan()
    assert same_bits(_cpu(dec)[~nan], vals[~nan]) and _cpu(dec)[nan].isnan().all()   # NaN payloads may differ
    ref = probe.to(fp8)
    assert torch.equal(_cpu(enc), ref.view(torch.uint8).to(torch.int32))
    if fp8 == torch.float8_e4m3fn: assert same_bits(_cpu(ev), ref.float())


@triton.jit
def _e2m1_kernel(x_ptr, c_ptr, v_ptr, n, T, B: tl.constexpr):
    offs = tl.arange(0, B)
    m = offs < n
    c = k_e2m1_encode(tl.load(x_ptr + offs, mask=m, other=0.0), T)
    tl.store(c_ptr + offs, c, mask=m)
    tl.store(v_ptr + offs, k_e2m1_decode(c), mask=m)


def test_e2m1_codes():
    "x / t to E2M1 codes as the eager codec (ties to the even code, saturation, -0 kept), and back."
    grid = E2M1_VALUES[:8]
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([7.0, 100.0, 1e-9, 0.0])])
    x = torch.cat([x, -x]) * 0.375
    c, v = torch.empty(x.numel(), dtype=torch.int32, device=DEV), torch.empty(x.numel(), device=DEV)
    _e2m1_kernel[(1,)](x.to(DEV), c, v, x.numel(), 0.375, 64)
    ref = e2m1_encode(x / 0.375)
    assert torch.equal(_cpu(c), ref.to(torch.int32)) and same_bits(_cpu(v), e2m1_decode(ref, torch.float32))


@triton.jit
def _dot_kernel(a_ptr, w_ptr, o_ptr, DOT: tl.constexpr, INTERP: tl.constexpr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    w = tl.load(w_ptr + r[:, None] * 16 + r[None, :])
    tl.store(o_ptr + r[:, None] * 16 + r[None, :], dot_acc(a, w, tl.zeros([16, 16], tl.float32) + 0.5, DOT, INTERP))


@pytest.mark.parametrize('dot', [0, 1, 2])
def test_dot_acc(dot):
    "acc + a @ w in fp32 from fp32 tiles, with the operands in fp32 (IEEE), fp16 or bf16 (rounded, not truncated)."
    g = torch.Generator().manual_seed(dot)
    a, w = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    o = torch.empty(16, 16, device=DEV)
    _dot_kernel[(1,)](a.to(DEV), w.to(DEV), o, dot, KB.interpreting())
    op = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}[dot]
    ref = a.to(op).double() @ w.to(op).double() + 0.5
    assert torch.allclose(_cpu(o).double(), ref, rtol=1e-6, atol=1e-5)            # fp32 accumulation of exact products
    if dot: assert not torch.allclose(_cpu(o).double(), a.double() @ w.double() + 0.5, rtol=1e-6, atol=1e-5)


def test_w8a8_linear_with_plain_quantizer():
    "The shared W8A8 driver with the per-token quantizer is eager INT8's linear; `who` names the caller in errors."
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (33, 96), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(33, generator=g) * 0.01, torch.randn(33, generator=g).bfloat16()
    x = torch.randn(2, 5, 96, generator=g).bfloat16()
    out = KB.w8a8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), bias.to(DEV), torch.float32, (None, None, 32),
                         KB.quantize_rows_int8, 'mine')
    assert same_bits(_cpu(out), int8_linear(x, w, ws, bias, out_dtype=torch.float32))
    with pytest.raises(ValueError, match='mine: x has K=96'):
        KB.w8a8_linear(x, w[:, :64], ws, None, None, (None,) * 3, KB.quantize_rows_int8, 'mine')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape,bk', [((33, 50), None), ((33, 50), 16), ((7, 130), 64), ((2, 3, 40), None)])
def test_quantize_rows_bit_exact(dtype, shape, bk):
    g = torch.Generator().manual_seed(hash((shape, bk)) % 1000)
    x = (torch.randn(*shape, generator=g) * 5).to(dtype)
    x[0, ..., :3] = 0.0
    q, s = KB.quantize_rows_int8(x.to(DEV), block_k=bk)
    qe, se = quantize_rows_int8(x)
    assert same_bits(_cpu(q), qe) and same_bits(_cpu(s), se)


@pytest.mark.parametrize('dtype', DTYPES)
def test_quantize_edge_values(dtype):
    "Zero rows (scale 1e-30), tiny rows (fp16 divisor underflow -> tiny), halfway quotients, huge values."
    fi = torch.finfo(dtype)
    x = torch.zeros(6, 20, dtype=torch.float32)
    x[1] = torch.linspace(-1, 1, 20) * 1e-7
    x[2] = torch.arange(20) * 0.5            # amax 9.5: many quotients near .5
    x[3] = torch.linspace(-1, 1, 20) * float(fi.max) / 2
    x[4, 0] = float(fi.tiny)
    x[5] = torch.tensor([127.0, 63.5, -63.5, 0.5, -0.5, 1.5, 2.5] + [0.0] * 13)
    x = x.to(dtype)
    q, s = KB.quantize_rows_int8(x.to(DEV))
    qe, se = quantize_rows_int8(x)
    assert same_bits(_cpu(q), qe) and same_bits(_cpu(s), se)



def _cuda_eager_quantize_rows(x):
    "cquant.int8.quantize_rows_int8 as torch computes it on CUDA: amax / 127 is amax * fp32(1/127) (a CPU scalar divisor)."
    scale = (x.abs().amax(-1, keepdim=True).float() * torch.tensor(KB.recip32(127.0))).clamp_(min=1e-30)
    d = scale.to(x.dtype)
    d = d.masked_fill(d == 0, torch.finfo(x.dtype).tiny)
    return (x / d).round_().clamp_(-128.0, 127.0).to(torch.int8), scale


@pytest.mark.parametrize('dtype', DTYPES)
def test_quantize_cuda_division_variant(dtype):
    "cuda_div=True reproduces the eager arithmetic on CUDA; on fp32 rows it differs from the CPU division for some scales."
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 40, generator=g) * torch.rand(64, 1, generator=g) * 10).to(dtype)
    x[0] = 0.0
    q, s = KB.quantize_rows_int8(x.to(DEV), cuda_div=True)
    qc, sc = _cuda_eager_quantize_rows(x)
    assert same_bits(_cpu(q), qc) and same_bits(_cpu(s), sc)
    if dtype == torch.float32: assert (sc != quantize_rows_int8(x)[1]).any()
    q, s = KB.quantize_rows_int8(x.to(DEV), cuda_div=False)              # explicit CPU arithmetic, whatever the device
    qe, se = quantize_rows_int8(x)
    assert same_bits(_cpu(q), qe) and same_bits(_cpu(s), se)
