"""The GPU path of the main job, tested on CPU: `quantize_checkpoint` with the Triton kernels as the layouts' fast paths
(run here by Triton's interpreter, as on a GPU they run compiled) writes the same bytes as the eager CPU path, and the
kernels really ran. A GPU run (`bench/bench_checkpoint.py --device cuda`, when a GPU is lent) checks the same on CUDA."""
import os
from collections import Counter
import pytest
import torch

if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton', reason='triton is not installed: the kernel path needs it')

import cquant as cq
from cquant import tensor
from cquant.jobs import quantize_checkpoint
from cquant.kernels import dispatch
from cquant.policy import Policy
from cquant.tensor import same_bits

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


@pytest.fixture(scope='module')
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp('device') / 'dit.safetensors'
    cq.save_file(cq.dit_state_dict(0, torch.bfloat16, depth=1, dim=128, heads=2, experts=2), p)
    return p


def _quantize(src, dst, mode, kernels:bool) -> Counter:
    "Quantize with or without the kernels; which fast paths ran, and how often."
    calls, saved = Counter(), {k: list(v) for k, v in tensor.FAST_PATHS.items()}
    def counted(key, fn):
        def run(*a, **k): calls[f'{key[0].__name__}.{key[1]}'] += 1; return fn(*a, **k)
        return run
    try:
        if kernels:
            dispatch.enable(cpu=True, strict=True)
            for key, paths in tensor.FAST_PATHS.items(): paths[:] = [(f, counted(key, g)) for f, g in paths]
        quantize_checkpoint(src, dst, Policy(mode, preset='none'), progress=False, device=DEV)
    finally:                        # the counting wrappers are not dispatch's: put the fast paths back as they were
        dispatch.disable(); tensor.FAST_PATHS.clear(); tensor.FAST_PATHS.update(saved)
    return calls


def test_the_fast_paths_are_restored(src, tmp_path):
    before = {k: list(v) for k, v in tensor.FAST_PATHS.items()}
    _quantize(src, tmp_path / 'k.safetensors', 'int8', kernels=True)
    assert tensor.FAST_PATHS == before


@pytest.mark.parametrize('mode', ['int8_convrot', 'nvfp4', 'int4_mixed'])
def test_kernel_path_writes_the_eager_bytes(src, tmp_path, mode):
    a, b = tmp_path / 'eager.safetensors', tmp_path / 'kernels.safetensors'
    assert not _quantize(src, a, mode, kernels=False)
    calls = _quantize(src, b, mode, kernels=True)
    assert any(k.endswith('.quantize') for k in calls) and any(k.endswith('.dequantize') for k in calls), calls
    A, B = cq.load_file(a), cq.load_file(b)
    assert sorted(A) == sorted(B)
    assert [k for k in A if not same_bits(A[k], B[k])] == []
    assert cq.read_header(a)[1]['cquant_summary'] == cq.read_header(b)[1]['cquant_summary']


def test_a_missing_gpu_is_a_clear_error(src, tmp_path):
    if torch.cuda.is_available(): pytest.skip('this machine has a GPU')
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA GPU here"):
        quantize_checkpoint(src, tmp_path / 'x.safetensors', Policy('int8'), progress=False, device='cuda')
    assert not os.listdir(tmp_path)
