"""Triton awq_w4a16 and svdquant_w4a4 kernels (`cquant.kernels.lowbit`) vs the eager references (`cquant.awq`,
`cquant.svdquant`).

Run on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before anything is imported
when there is no CUDA). Skipped when triton is not installed. Decodes and the activation quantizer must be
bit-exact; the linears must stay within `awq_linear_error_bound` / `svdquant_linear_error_bound`.
"""
import os
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

import torch.nn.functional as F
import cquant as cq
from cquant.awq import dequantize_awq, awq_linear, AWQLayout
from cquant.svdquant import svdquant_activations, residual_weight, svdquant_weight, svdquant_linear, SVDQuantLayout
from cquant.numerics import pack_uint4, unpack_int4
from cquant.tensor import same_bits, FAST_PATHS
from cquant.kernels import dispatch
import cquant.kernels.lowbit as K

# fp16 overflow of huge scales happens on purpose inside the interpreter's numpy arithmetic (eager gives the same inf)
# Triton's interpreter on CPU: the full tier; the quick tier checks each kernel in its notebook (nbs/3N_kernels_*)
pytestmark = [pytest.mark.long, pytest.mark.filterwarnings('ignore:overflow encountered:RuntimeWarning')]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
TILED = 'kitchen_tile_packed_w4a4'
_CACHE = {}


def _dev(*ts): return [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in ts]


def _bits(a, b): return same_bits(a.cpu(), b)


def _within(out, ref, bound, tight=0.03):
    """|out - ref| <= bound everywhere, and the bound means something: <= `tight` of max |ref| (svdquant in bf16:
    6%, eager's bf16 rounding of every q * s, a relative 2**-7 of sum |q_x s_x q_w s_w|)."""
    err = (out.cpu().double() - ref.double()).abs()
    assert bool((err <= bound.cpu()).all()), f'error {err.max().item():.3g} over the bound'
    assert bound.max().item() <= tight * ref.double().abs().max().item() + 1e-30, 'vacuous bound'


def _awq(N=37, Kd=192, sdt=torch.bfloat16, G=64, seed=1):
    key = ('awq', N, Kd, sdt, G, seed)
    if key not in _CACHE:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(N, Kd, generator=g); w[:, 3] *= 25
        qt = cq.quantize(w.to(sdt), 'awq_w4a16', group_size=G)
        _CACHE[key] = (qt.qdata, qt.params.scale, qt.params.zeros)
    return _CACHE[key]


def _svdq(N=128, Kd=192, dt=torch.bfloat16, seed=2, **opts):
    key = ('svdq', N, Kd, dt, seed, tuple(sorted(opts.items())))
    if key not in _CACHE:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(N, Kd, generator=g); w[:, 7] *= 20
        _CACHE[key] = cq.quantize(w.to(dt), 'svdquant_w4a4', **opts)
    return _CACHE[key]


def _svdq_args(qt, smooth=None):
    p = qt.params
    return qt.qdata, p.scale, p.proj_down, p.proj_up, p.smooth_factor if smooth is None else smooth


# ---- awq_w4a16 ----

@pytest.mark.parametrize('sdt', DTYPES)
def test_awq_dequantize_every_code_and_dtype(sdt):
    "All 16 codes in every group; zero, negative, subnormal and huge scales; every output dtype (mixed ones promote)."
    g = torch.Generator().manual_seed(0)
    q = pack_uint4(torch.arange(16, dtype=torch.uint8).repeat(24, 8))
    s = torch.randn(2, 24, generator=g)
    s[0, :4] = torch.tensor([0.0, -2.5, 3e-6, 6e4]); s[1, :2] = torch.tensor([1e-30, 7.0])
    z = torch.randn(2, 24, generator=g) * 3
    s, z = s.to(sdt), z.to(sdt)
    for dt in (None, *DTYPES):
        assert _bits(K.dequantize_awq(*_dev(q, s, z), 64, dt), dequantize_awq(q, s, z, 64, dt)), dt
    assert _bits(K.dequantize_awq(*_dev(q.view(torch.uint8), s, z), 64), dequantize_awq(q, s, z, 64))


@pytest.mark.parametrize('G', [8, 64, 96])
def test_awq_dequantize_groups_ragged(G):
    q, s, z = _awq(Kd=192, G=G)
    out = K.dequantize_awq(*_dev(q, s, z), G, block_n=16, block_k=32)        # 37 rows: ragged tiles
    assert _bits(out, dequantize_awq(q, s, z, G))


def test_awq_dequantize_worked_group():
    w = K.dequantize_awq(*_dev(pack_uint4(torch.arange(16, dtype=torch.uint8)[None]), torch.full((1, 1), 0.5),
                               torch.ones(1, 1)), 16)
    assert w.cpu()[0].tolist() == [(c - 8) / 2 + 1 for c in range(16)]


@pytest.mark.parametrize('sdt', DTYPES)
@pytest.mark.parametrize('xdt', DTYPES)
@pytest.mark.parametrize('M', [1, 5, 20])
def test_awq_linear_within_bound(sdt, xdt, M):
    "M = 1 and 5 run the GEMV kernel, 20 the tl.dot GEMM; a bias on odd M."
    w = _awq(sdt=sdt)
    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, 192, generator=g) * 2).to(xdt)
    b = torch.randn(37, generator=g).to(xdt) if M % 2 else None
    out, ref = K.awq_linear(*_dev(x, *w, b)), awq_linear(x, *w, b)
    assert out.dtype == ref.dtype == xdt and out.shape == ref.shape
    _within(out, ref, K.awq_linear_error_bound(x, *w, b))


@pytest.mark.parametrize('gemv', [True, False])
def test_awq_linear_forced_kernels_3d(gemv):
    w = _awq()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 192, generator=g).bfloat16()
    out = K.awq_linear(*_dev(x, *w), gemv=gemv, block_m=16, block_n=16, block_k=32)
    assert out.shape == (2, 9, 37)
    _within(out, awq_linear(x, *w), K.awq_linear_error_bound(x, *w))


def test_awq_errors():
    q, s, z = _awq()
    with pytest.raises(ValueError, match='awq_linear: x has K=64'):
        K.awq_linear(torch.zeros(2, 64), q, s, z)
    with pytest.raises(ValueError, match=r'dequantize_awq: zeros must be .* \(3, 37\)'):
        K.dequantize_awq(q, s, z[:2])
    with pytest.raises(ValueError, match='group_size must be even'):
        K.dequantize_awq(q, s, z, 7)


# ---- svdquant_w4a4 ----

def _act_input(dt, M=6, Kd=320, seed=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, Kd, generator=g) * 2
    x[0, 3] = 90.0; x[1] *= 1e-6 if dt == torch.float16 else 1e-12              # 1e-12: under the 1e-10 floor
    x[2, :64] = torch.arange(64) * 0.5 - 16; x[3, 64:128] = 0; x[4] *= 3e3
    return x.to(dt)


@pytest.mark.parametrize('xdt', DTYPES)
@pytest.mark.parametrize('sdt', DTYPES)
@pytest.mark.parametrize('unsigned', [False, True])
def test_svdquant_activations_bit_exact(xdt, sdt, unsigned):
    x = _act_input(xdt)
    if torch.promote_types(xdt, sdt) == torch.float16: x[3, 64:128] = 1.0     # a zero group: eager casts NaN codes
    if unsigned: x = x.abs()
    sm = (torch.rand(320, generator=torch.Generator().manual_seed(5)) + 0.5).to(sdt)
    q, s = K.svdquant_activations(*_dev(x, sm), unsigned, block_m=4)
    qe, se = svdquant_activations(x, sm, unsigned)
    assert _bits(q, qe) and _bits(s, se)
    assert q.cpu().min() >= (0 if unsigned else -7) and q.cpu().max() <= (15 if unsigned else 7)


def test_svdquant_activations_shift_and_cuda_division():
    x, sm = _act_input(torch.bfloat16), torch.rand(320, generator=torch.Generator().manual_seed(6)) + 0.5
    got = K.svdquant_activations(*_dev(x, sm.bfloat16()), True, shift=True)
    ref = svdquant_activations(x + 0.171875, sm.bfloat16(), True)
    assert _bits(got[0], ref[0]) and _bits(got[1], ref[1])
    x = _act_input(torch.float32)
    v = (x / sm).view(6, 5, 64)
    se = v.abs().amax(-1).clamp(min=1e-10) * torch.tensor(1 / 7)                 # CUDA: times fp32(1/7)
    qe = (v / se[..., None]).round().clamp(-7, 7).to(torch.int8).view(6, 320)
    q, s = K.svdquant_activations(*_dev(x, sm), cuda_div=True)
    assert _bits(q, qe) and _bits(s, se)


@pytest.mark.parametrize('variant', ['bf16', 'fp16', 'fp32', 'tiled', 'smoothed'])
def test_svdquant_residual_and_weight_bit_exact(variant):
    qt = {'bf16': lambda: _svdq(), 'fp16': lambda: _svdq(dt=torch.float16, rank=8),
          'fp32': lambda: _svdq(dt=torch.float32, rank=4), 'tiled': lambda: _svdq(layout=TILED),
          'smoothed': lambda: _svdq()}[variant]()
    sm = (torch.rand(192, generator=torch.Generator().manual_seed(7)) * 4 + 0.25).bfloat16() \
        if variant == 'smoothed' else None
    a = _svdq_args(qt, sm)
    assert _bits(K.residual_weight(*_dev(*a[:2])), residual_weight(*a[:2]))
    ref = svdquant_weight(*a)
    for dt in (None, *DTYPES):
        assert _bits(K.svdquant_weight(*_dev(*a), dtype=dt), ref if dt is None else ref.to(dt)), dt


@pytest.mark.parametrize('variant', ['bf16', 'fp16', 'fp32', 'tiled'])
@pytest.mark.parametrize('unsigned', [False, True])
def test_svdquant_linear_within_bound(variant, unsigned):
    qt = {'bf16': lambda: _svdq(), 'fp16': lambda: _svdq(dt=torch.float16, rank=8),
          'fp32': lambda: _svdq(dt=torch.float32, rank=4), 'tiled': lambda: _svdq(layout=TILED)}[variant]()
    a, dt = _svdq_args(qt), qt.params.scale.dtype
    g = torch.Generator().manual_seed(8 + unsigned)
    for x, b, kw in ((torch.randn(5, 192, generator=g), torch.randn(128, generator=g), {}),
                     (torch.randn(3, 7, 192, generator=g), None, dict(block_m=16, block_n=32))):
        x = (F.gelu(x) if unsigned else x).to(dt)
        b = None if b is None else b.to(dt)
        out, ref = K.svdquant_linear(*_dev(x, *a, b), unsigned, **kw), svdquant_linear(x, *a, b, unsigned)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        _within(out, ref, K.svdquant_linear_error_bound(x, *a, b, unsigned), 0.06)


def test_svdquant_linear_integer_part():
    "With the branch off: within the fp32 group rescale and group sum of the exact sum of code products."
    qt = _svdq(N=40, Kd=640, dt=torch.float32, rank=4)
    q, s, dn, up, sm = _svdq_args(qt)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(9))
    xq, xs = svdquant_activations(x, sm)
    cw = unpack_int4(q).double().view(40, 10, 64)
    terms = lambda f: torch.einsum('mgk,ngk,mg,gn->mn', f(xq.double().view(9, 10, 64)), f(cw), f(xs.double()),
                                   f(s.double()))
    exact, P = terms(lambda t: t), terms(torch.abs)
    out = K.svdquant_linear(*_dev(x, q, s, dn, torch.zeros_like(up), sm)).cpu().double()
    u = 2.0 ** -24
    assert bool(((out - exact).abs() <= (10 * u / (1 - 10 * u) + 3 * u) * P + u * exact.abs()).all())


def test_svdquant_errors():
    qt = _svdq()
    a = _svdq_args(qt)
    with pytest.raises(ValueError, match="svdquant_linear: expected x \\[..., 192\\] in the scales' dtype"):
        K.svdquant_linear(torch.zeros(2, 192), *a)
    with pytest.raises(ValueError, match='svdquant_activations: expected x'):
        K.svdquant_activations(torch.zeros(2, 100), torch.ones(100))


# ---- registration ----

def test_fast_paths_through_dispatch():
    "enable(cpu=True) routes F.linear and dequantize of both formats to the kernels: bits, or the bound."
    g = torch.Generator().manual_seed(10)
    qts = [cq.quantize(torch.randn(37, 192, generator=g).bfloat16(), 'awq_w4a16'), _svdq(), _svdq(layout=TILED)]
    x = torch.randn(4, 192, generator=g).bfloat16()
    eager = [(qt.dequantize(torch.float32), F.linear(x, qt)) for qt in qts]
    try:
        got = dispatch.enable(cpu=True, strict=True, modules=['lowbit'])
        assert {('AWQLayout', 'dequantize', 'lowbit'), ('AWQLayout', 'linear', 'lowbit'),
                ('SVDQuantLayout', 'dequantize', 'lowbit'), ('SVDQuantLayout', 'linear', 'lowbit')} == set(got)
        for qt, (de, ye) in zip(qts, eager):
            assert any(f(x, qt.qdata, qt.params, None) for f, _ in FAST_PATHS[(qt.layout, 'linear')])
            assert _bits(qt.dequantize(torch.float32), de)
            p = qt.params
            bound = (K.awq_linear_error_bound(x, qt.qdata, p.scale, p.zeros) if qt.layout is AWQLayout
                     else K.svdquant_linear_error_bound(x, *_svdq_args(qt), None, p.act_unsigned))
            _within(F.linear(x, qt), ye, bound, 0.06)
            assert not any(f(x[:, :64], qt.qdata, p, None) for f, _ in FAST_PATHS[(qt.layout, 'linear')])
    finally:
        dispatch.disable()
    assert (AWQLayout, 'linear') not in FAST_PATHS and (SVDQuantLayout, 'linear') not in FAST_PATHS


def test_harness_smoke_lowbit(tmp_path):
    "kernels/harness.py --smoke for the two formats: dequantize bit-exact, the linears recorded, no peer errors."
    import importlib.util, json, pathlib
    path = pathlib.Path(__file__).parents[1] / 'kernels' / 'harness.py'
    spec = importlib.util.spec_from_file_location('harness', path)
    harness = importlib.util.module_from_spec(spec); spec.loader.exec_module(harness)
    out = tmp_path / 'h.json'
    assert harness.main(['--smoke', '--formats', 'awq_w4a16,svdquant_w4a4,svdquant_tiled', '--out', str(out)]) == 0
    res = json.loads(out.read_text())
    got = {(r['kernel'], r['case']): r for r in res['records']}
    for case in ('awq_w4a16', 'svdquant_w4a4', 'svdquant_tiled'):
        assert got[('dequantize', case)]['exact']
        assert ('linear', case) in got and got[('linear', case)]['rel_diff'] < 0.02
    assert res['peer_errors'] == []
    assert not FAST_PATHS


SHARED_SM89 = 101376      # bytes of shared memory one block may use on sm_86/sm_89 (the smallest of sm_80..sm_90)

_AOT = r'''
import inspect, os, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import cquant.kernels.lowbit as L
P8, F, BF, I16 = '*i8', '*fp32', '*bf16', '*i16'
IDX = dict(M='i32', N='i32', K='i32', R='i32', FLOOR='fp32', SHIFT_V='fp32')
CASES = [
    (L._awq_dequant_kernel, dict(q_ptr=P8, s_ptr=BF, z_ptr=BF, o_ptr=I16), dict(G=64, SKIND=2, CKIND=2, KIND=2,
                                                                                BLOCK_N=32, BLOCK_K=256)),
    (L._awq_gemv_kernel, dict(x_ptr=BF, q_ptr=P8, s_ptr=BF, z_ptr=BF, b_ptr=BF, o_ptr=I16),
     dict(G=64, XKIND=2, SKIND=2, HAS_BIAS=True, KIND=2, BLOCK_N=32, BLOCK_K=128)),
    (L._awq_gemm_kernel, dict(x_ptr=BF, q_ptr=P8, s_ptr=BF, z_ptr=BF, b_ptr=BF, o_ptr=I16),
     dict(G=64, XKIND=2, SKIND=2, HAS_BIAS=True, KIND=2, INTERP=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128)),
    (L._svdq_act_kernel, dict(x_ptr=BF, sm_ptr=BF, q_ptr=P8, s_ptr=I16),
     dict(XKIND=2, SMKIND=2, PKIND=2, UNSIGNED=True, QMAX=15.0, RD=0.06666667014360428, SHIFT=True, CUDA_DIV=True,
          BLOCK_M=4, NG=16)),
    (L._svdq_residual_kernel, dict(q_ptr=P8, s_ptr=BF, a_ptr=BF, l_ptr=F, o_ptr=I16),
     dict(SKIND=2, FULL=True, TILED=True, KIND=2, BLOCK_N=32, BLOCK_K=256)),
    *[(L._svdq_gemm_kernel, dict(a_ptr=P8, as_ptr=I16, w_ptr=P8, ws_ptr=BF, l_ptr=F, u_ptr=BF, b_ptr=BF, o_ptr=I16),
       dict(UKIND=2, HAS_BIAS=True, KIND=2, RB=32, TILED=tiled, BLOCK_M=64, BLOCK_N=64)) for tiled in (False, True)],
]
for kernel, ptrs, consts in CASES:
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: 'constexpr' if n in consts else {**ptrs, **IDX}[n] for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget('cuda', int(sys.argv[1]), 32), options={'enable_fp_fusion': False})
    assert len(k.asm['cubin']) > 1000, kernel.fn.__name__
    print(kernel.fn.__name__, 'ok', k.metadata.shared)
'''


@pytest.mark.long
def test_kernels_compile_offline_for_sm80(compile_offline):
    """Every low-bit kernel (bf16, one tile each) compiles to an sm_80 cubin with triton's own ptxas, no GPU needed:
    what the interpreter cannot show. Not a run: no GPU has executed them."""
    out = compile_offline(_AOT, '80')
    assert out.count(' ok') == 7
    shared = {l.split()[0]: int(l.split()[2]) for l in out.splitlines() if ' ok ' in l}
    assert max(shared.values()) <= SHARED_SM89, shared          # fits an RTX 4090's shared memory too
