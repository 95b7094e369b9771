"""The Triton SOL attention forward (nbs/36_kernels_sol.ipynb) against the reference `cq.sol_attention`, under
Triton's CPU interpreter on small shapes: the kernel's own routing agrees with `sol_plan`'s except for flips within
the stated tolerance, and the output is within the stated bound on the live rows, for random and chosen calls."""
import importlib
import os
import random
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

import cquant as cq
import cquant.kernels.sol as K
from cquant.sol_attention import random_sol_case

# Triton's interpreter on CPU: the full tier; the quick tier checks each kernel in its notebook (nbs/3N_kernels_*)
pytestmark = pytest.mark.long

S = importlib.import_module('cquant.sol_attention')    # the module (cq.sol_attention is the function)


@pytest.mark.parametrize('seed', range(4))
def test_kernel_within_bound(seed):
    "Two random calls per seed (ragged T, B <= 2, H <= 3, D 64/128, fp32/bf16/fp16, every option incl. coarse_gate)."
    rng = random.Random(3600 + seed)
    for i in range(2):
        q, k, v, kw = random_sol_case(rng, 3600 + 2 * seed + i, t_max=140)
        err = K.sol_kernel_error(q, k, v, **kw)
        assert err <= 1, (tuple(q.shape), q.dtype, {n: getattr(o, 'shape', o) for n, o in kw.items()}, err)


CASES = [  # (T, H, D, options): both routing modes, sinks, sink_q, block_len, key_bias, tail=False, D 64 and 128
    (300, 2, 64, dict(tau=0.5)),
    (300, 1, 128, dict(tau=1.5, sink_blocks=[0, 1], sink_q=[4, 5])),
    (257, 2, 64, dict(topk_ratio=0.4)),
    (300, 1, 128, dict(topk_ratio=0.3, sink_blocks=[1, 3], key_bias='float')),
    (290, 2, 64, dict(tau=0.0, block_len='ragged', tail=False)),
    (320, 1, 64, dict(topk_ratio=0.6, sink_q=[0, 1], block_len='ragged', key_bias='bool')),
]


def _case(t, h, d, options, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, t, h, d, generator=g) for _ in range(3))
    kw = dict(options)
    if kw.get('block_len') == 'ragged': kw['block_len'] = torch.randint(20, 64, (S.block_count(t),), generator=g,
                                                                        dtype=torch.int32)
    if kw.get('key_bias') == 'float': kw['key_bias'] = torch.randn(2, t, generator=g)
    if kw.get('key_bias') == 'bool': kw['key_bias'] = torch.rand(t, generator=g) > 0.2
    return q, k, v, kw


@pytest.mark.parametrize('case', range(len(CASES)))
def test_routing_agrees_within_tolerance(case):
    "The kernel's routing row = sol_plan's exact, except flips within tolerance; pooled logits and output in bound."
    t, h, d, options = CASES[case]
    q, k, v, kw = _case(t, h, d, options, 3700 + case)
    plan = S.sol_plan(q, k, v, **kw)
    margin, tol = K.route_margins(q, plan, **kw)
    r = K.sol_kernel_report(q, k, v, **kw)
    assert r['unexplained'] == 0 and r['flips'] <= int((margin <= tol).sum()), r
    assert r['pooled'] <= 1 and r['err'] <= 1, r
    assert K.sol_kernel_error(q, k, v, **kw) == r['err']


def test_flips_at_the_cut_are_explained():
    "Proxy scores at 0 +- rounding with tau = 0 (and near-ties in top-k): flips happen, all within the tolerance."
    q, k, v = K.threshold_edge_qkv(t=260, h=3)
    for kw in (dict(tau=0.0), dict(topk_ratio=0.5)):
        r = K.sol_kernel_report(q, k, v, **kw)
        assert r['flips'] > 0 and r['unexplained'] == 0 and r['routing_ok'] and r['err'] <= 1, (kw, r)


def test_a_wrong_routing_is_unexplained(monkeypatch):
    "The check is not vacuous: one block routed the wrong way outside the tolerance counts; sol_kernel_error is inf."
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 300, 1, 64, generator=g) for _ in range(3))
    margin, tol = K.route_margins(q, S.sol_plan(q, k, v, tau=1.0), tau=1.0)
    ratio = (margin / tol).masked_fill(margin.isinf(), 0)[0, 0]              # forced blocks left out
    i, j = divmod(int(ratio.argmax()), ratio.shape[-1])
    assert ratio[i, j] > 1
    run = K.sol_kernel_run

    def wrong(*args, **kw):
        out, (exact, pooled) = run(*args, **kw)
        exact = exact.clone(); exact[0, 0, i, j] = ~exact[0, 0, i, j]
        return out, (exact, pooled)
    monkeypatch.setattr(K, 'sol_kernel_run', wrong)
    r = K.sol_kernel_report(q, k, v, tau=1.0)
    assert (r['flips'], r['unexplained'], r['routing_ok']) == (1, 1, False)
    assert K.sol_kernel_error(q, k, v, tau=1.0) == float('inf')


def test_host_passes_no_block_by_block_table(monkeypatch):
    "The kernel path builds no (N, N) routing: no sol_plan call, no [.., N, N] launch argument (debug off)."
    def boom(*a, **kw): raise AssertionError('sol_plan called on the kernel path')
    monkeypatch.setattr(K, 'sol_plan', boom)
    monkeypatch.setattr(S, 'sol_plan', boom)
    launched = []
    kernel = K._sol_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append([a.shape for a in args if isinstance(a, torch.Tensor)])
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(K, '_sol_fwd_kernel', Spy())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 300, 2, 64, generator=g) for _ in range(3))
    out = K.sol_attention_kernel(q, k, v, tau=0.5, topk_ratio=0.3)
    n = S.block_count(300)
    (shapes,) = launched
    assert all(tuple(sh[-2:]) != (n, n) for sh in shapes), shapes
    assert out.shape == q.shape and out.isfinite().all()


def test_kernel_is_not_the_reference_rerun():
    "The bound is not vacuous: the kernel's fp32 result differs from the reference somewhere, by rounding only."
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 130, 2, 64, generator=g) for _ in range(3))
    out, ref = K.sol_attention_kernel(q, k, v, tau=0.5), cq.sol_attention(q, k, v, tau=0.5)
    assert not torch.equal(out, ref) and (out - ref).abs().max() < 1e-5 * v.abs().max()


def test_kernel_head_dim_must_be_a_power_of_two():
    x = torch.zeros(1, 64, 1, 96)
    with pytest.raises(ValueError, match='sol_attention_kernel: head dim must be a power of 2 >= 16, got 96'):
        K.sol_attention_kernel(x, x, x)


def test_harness_smoke_sol(tmp_path):
    "kernels/harness.py --smoke --formats sol_attention: the attention record, within the bound, peers ran once."
    import importlib.util, json, pathlib
    path = pathlib.Path(__file__).parents[1] / 'kernels' / 'harness.py'
    spec = importlib.util.spec_from_file_location('harness', path)
    harness = importlib.util.module_from_spec(spec); spec.loader.exec_module(harness)
    out = tmp_path / 'h.json'
    assert harness.main(['--smoke', '--formats', 'sol_attention', '--out', str(out)]) == 0
    res = json.loads(out.read_text())
    assert res['peer_errors'] == []
    (r,) = res['records']
    assert (r['kernel'], r['T'], r['within_bound']) == ('sol_attention', 128, True) and 0 < r['err_over_bound'] <= 1
