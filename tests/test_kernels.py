"""Triton INT8 kernels vs the eager reference (`cquant.int8`), run on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before `@triton.jit` runs, i.e. before `cquant.kernels.base` is imported,
so it is set here at the top (only when there is no CUDA GPU). Skipped when triton is not installed.
"""
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

from cquant.int8 import quantize_rows_int8, dequantize_int8, int_mm, int8_linear
from cquant.tensor import same_bits
import cquant.kernels.int8 as K
import cquant.kernels.base as KB

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def _cpu(t): return t.cpu()


def test_bf16_tiny_and_subnormal_inputs():
    """bf16 subnormals are read exactly (Triton's interpreter misreads them in a plain bf16 -> fp32 conversion):
    rows of tiny and subnormal activations, and a subnormal bf16 bias that a zero activation row returns as is."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=g)
    x[0] *= 1e-39; x[1] *= 1e-36; x[2] *= 2e-38; x[3, :8] = torch.tensor([1e-40, -2e-39, 9.2e-41, 1e-45, 5e-39, 1.2e-38, -3e-38, 7.0])
    x[4] = 0.0
    x = x.to(torch.bfloat16)
    assert (x.float().abs() < torch.finfo(torch.bfloat16).tiny).logical_and(x != 0).any()   # really subnormal
    q, s = KB.quantize_rows_int8(x.to(DEV))
    qe, se = quantize_rows_int8(x)
    assert same_bits(_cpu(q), qe) and same_bits(_cpu(s), se)
    w = torch.randint(-127, 128, (33, 64), dtype=torch.int8, generator=g)
    ws = torch.rand(33, generator=g) * 1e-3
    bias = (torch.randn(33, generator=g) * 1e-39).to(torch.bfloat16)
    for od in (torch.float16, torch.float32, torch.bfloat16):
        out = K.int8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), bias.to(DEV), out_dtype=od, block_k=32)
        ref = int8_linear(x, w, ws, bias, out_dtype=od)
        assert same_bits(_cpu(out), ref), od
    assert torch.equal(_cpu(out)[4].float(), bias.float()) and bias.ne(0).any()   # the zero row: 0 + bias


def test_bf16_nan_is_kept():
    "A NaN with all low mantissa bits set (0x7FFFFFFF, GPU arithmetic's NaN) stays NaN in a bf16 output (no rounding carry to -0.0)."
    q = torch.tensor([[1, -3, 0, 127]], dtype=torch.int8)
    nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    out = K.dequantize_int8(q.to(DEV), nan.to(DEV), torch.bfloat16)
    assert _cpu(out).isnan().all()
    assert (_cpu(out).view(torch.int16) & 0x7FFF).eq(0x7FC0).all()

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(33, 50), (7, 130)])
def test_dequantize_bit_exact(dtype, shape):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    for s in (torch.rand(shape[0], 1, generator=g) * 10, torch.tensor(0.0371), torch.tensor([3e-3])):
        out = K.dequantize_int8(q.to(DEV), s.to(DEV), dtype, block_k=64)
        assert same_bits(_cpu(out), dequantize_int8(q, s, dtype)), (dtype, s.shape)


@pytest.mark.parametrize('MNK', [(5, 33, 64), (5, 33, 96), (1, 17, 40)])
def test_int8_mm_exact(MNK):
    M, N, Kd = MNK
    g = torch.Generator().manual_seed(2)
    a = torch.randint(-128, 128, (M, Kd), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (N, Kd), dtype=torch.int8, generator=g)
    a[0] = -128; w[0] = -128                 # extreme products
    out = K.int8_mm(a.to(DEV), w.to(DEV), block_k=32)
    assert out.dtype == torch.int32
    assert torch.equal(_cpu(out), int_mm(a, w.t()))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('K_', [64, 96])
@pytest.mark.parametrize('per_n', [True, False])
@pytest.mark.parametrize('with_bias', [True, False])
def test_int8_linear_bit_exact(dtype, K_, per_n, with_bias):
    g = torch.Generator().manual_seed(K_ + per_n + 2 * with_bias)
    M, N = 5, 33
    x = (torch.randn(M, K_, generator=g) * 2).to(dtype)
    w = torch.randint(-127, 128, (N, K_), dtype=torch.int8, generator=g)
    ws = torch.rand(N, 1, generator=g) * 0.02 if per_n else torch.tensor(0.013)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    out = K.int8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), None if bias is None else bias.to(DEV), block_k=32)
    ref = int8_linear(x, w, ws, bias)
    assert out.dtype == ref.dtype and same_bits(_cpu(out), ref)


def test_int8_linear_3d_fp32_bias_into_bf16():
    "Leading dims are kept; an fp32 bias is cast to the output dtype before the add, as eager does."
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    w = torch.randint(-127, 128, (33, 64), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(33, generator=g) * 0.02, torch.randn(33, generator=g)
    out = K.int8_linear(x.to(DEV), w.to(DEV), ws.to(DEV), bias.to(DEV))
    assert out.shape == (2, 3, 33)
    assert same_bits(_cpu(out), int8_linear(x, w, ws, bias))


def test_errors():
    with pytest.raises(ValueError, match='int8_mm'):
        K.int8_mm(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(3, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match='weight scale'):
        K.int8_linear(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.int8), torch.ones(2))
    with pytest.raises(ValueError, match='float32, float16 or bfloat16'):
        KB.quantize_rows_int8(torch.zeros(2, 4, dtype=torch.float64))


def test_harness_smoke(tmp_path):
    "kernels/harness.py --smoke: every code path of the GPU harness, on tiny shapes through the interpreter."
    import importlib.util, json, pathlib
    path = pathlib.Path(__file__).parents[1] / 'kernels' / 'harness.py'
    spec = importlib.util.spec_from_file_location('harness', path)
    harness = importlib.util.module_from_spec(spec); spec.loader.exec_module(harness)
    out = tmp_path / 'h.json'
    assert harness.main(['--smoke', '--formats', 'int8_row,fp8_e4m3,int8_attention', '--out', str(out)]) == 0
    res = json.loads(out.read_text())
    recs = res['records']
    assert res['peer_errors'] == []             # torch and comfy-kitchen peers ran once (eager backends on CPU)
    got = {(r['kernel'], r['case']) for r in recs}
    assert {('quantize', 'int8_row'), ('dequantize', 'int8_row'), ('linear', 'int8_row')} <= got
    assert all(r['exact'] for r in recs if r['case'] == 'int8_row')
    att = [r for r in recs if r['kernel'] == 'attention']
    assert [r['case'] for r in att] == ['int8_attention'] and att[0]['max_diff'] < 1e-4, att
    from cquant.tensor import FAST_PATHS
    assert not FAST_PATHS                       # the harness leaves the eager layouts in place
