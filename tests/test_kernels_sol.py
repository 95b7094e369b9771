"""The Triton SOL attention forward (nbs/36_kernels_sol.ipynb) against the reference `cq.sol_attention`, under
Triton's CPU interpreter on small shapes: within the stated bound on the live rows, for random calls."""
import os
import random
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel tests need it')

import cquant as cq
import cquant.kernels.sol as K
from cquant.sol_attention import random_sol_case


@pytest.mark.parametrize('seed', range(4))
def test_kernel_within_bound(seed):
    "Two random calls per seed (ragged T, B <= 2, H <= 3, D 64/128, fp32/bf16/fp16, every option incl. coarse_gate)."
    rng = random.Random(3600 + seed)
    for i in range(2):
        q, k, v, kw = random_sol_case(rng, 3600 + 2 * seed + i, t_max=140)
        err = K.sol_kernel_error(q, k, v, **kw)
        assert err <= 1, (tuple(q.shape), q.dtype, {n: getattr(o, 'shape', o) for n, o in kw.items()}, err)


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
