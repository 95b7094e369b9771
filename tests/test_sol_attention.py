"""SOL attention (nbs/24_sol_attention.ipynb): bit for bit against comfy-kitchen's eager `sol_attn`, chunked = one chunk,
and checked inputs. Cases are drawn from a seeded generator (shapes, dtypes, taus and every option)."""
import math, random
import pytest
import torch
import cquant as cq
from cquant.sol_attention import chunking_report, random_sol_case, query_chunks

kitchen = pytest.importorskip('comfy_kitchen.backends.eager.sol_attn')


@pytest.mark.parametrize('seed', range(0, 120, 15))
def test_bit_exact_with_kitchen(seed):
    "15 random calls per seed; T up to 330 (ragged blocks), B <= 2, H <= 3, D in 64/128, fp32/bf16/fp16, all options."
    rng = random.Random(seed)
    for i in range(seed, seed + 15):
        q, k, v, kw = random_sol_case(rng, i, t_max=330)
        ref = kitchen.sol_attn(q, k, v, **kw)
        out = cq.sol_attention(q, k, v, **kw)
        assert out.dtype == v.dtype and out.is_contiguous()
        assert torch.equal(out, ref), (i, tuple(q.shape), q.dtype, {n: getattr(o, 'shape', o) for n, o in kw.items()})


def test_every_option_is_drawn():
    "The random cases above do exercise each option, dtype, head dim and a ragged T (the sampler is not vacuous)."
    rng, seen = random.Random(0), set()
    for i in range(200):
        q, k, v, kw = random_sol_case(rng, i, t_max=330)
        seen |= set(kw) | {q.dtype, q.shape[-1], 'ragged' if q.shape[1] % 64 else 'whole', 'B>1' if q.shape[0] > 1 else 'B=1'}
    assert {'scale', 'sink_blocks', 'sink_q', 'topk_ratio', 'tail', 'block_len', 'coarse_gate', 'key_bias',
            torch.float32, torch.bfloat16, torch.float16, 64, 128, 'ragged', 'whole', 'B>1'} <= seen


@pytest.mark.parametrize('seed', range(6))
def test_chunked_equals_one_chunk(seed):
    """Every chunk's logits are the one-chunk logits; every differing probability is the vector vs scalar exp2 of one
    logit; rows with equal probabilities are equal. The GEMM row-invariance is the BLAS's: detected, then skipped."""
    rng = random.Random(1000 + seed)
    q, k, v, kw = random_sol_case(rng, 1000 + seed, t_max=330)
    kw.pop('coarse_gate', None)                 # added after the chunks, on the whole output
    r = chunking_report(q, k, v, query_blocks=rng.choice([1, 2, 3]), **kw)
    if not r['gemm_rows']: pytest.skip("this BLAS's GEMM rows depend on the row count: chunked results are not claimed")
    assert r == dict(gemm_rows=True, exp2_only=True, bad_rows=0), (seed, tuple(q.shape), kw)


def test_chunked_output_equals_kitchen_where_probabilities_agree():
    "Through the public function: chunked rows are kitchen's rows, or differ only where exp2's paths do (few rows)."
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 300, 2, 128, generator=g, dtype=torch.float32) for _ in range(3))
    ref = kitchen.sol_attn(q, k, v, tau=0.5)
    assert torch.equal(cq.sol_attention(q, k, v, tau=0.5), ref)
    out = cq.sol_attention(q, k, v, tau=0.5, query_blocks=1)
    rows = (out != ref).any(-1)
    assert rows.float().mean() < 0.05 and (out - ref).abs().max() < 1e-5


def test_long_sequences_are_chunked():
    "T = 8192, 8 heads: 15 query blocks (about 256 MiB of logits) per chunk, never a chunk under 64 rows."
    chunks = query_chunks(1, 8192, 8)
    assert chunks[0] == (0, 960) and chunks[-1] == (7680, 8192) and len(chunks) == 9
    assert all(r1 - r0 >= 64 for r0, r1 in query_chunks(1, 8193, 8, 1)) and query_chunks(1, 8193, 8, 1)[-1] == (8128, 8193)


def test_kitchen_refuses_what_sol_attention_runs():
    "Kitchen's O(T^2) guard: 4 GiB of scores. cquant's chunks run the same call (checked only for the refusal here)."
    x = torch.zeros(1, 8192, 17, 8)
    with pytest.raises(RuntimeError, match='O\\(T\\^2\\)'): kitchen.sol_attn(x, x, x)


B, T, H, D = 2, 70, 2, 64
X = torch.randn(B, T, H, D)


@pytest.mark.parametrize('kw, match', [
    (dict(q=X[0]), r'q must be a \(B, T, H, D\) tensor, got \(70, 2, 64\)'),
    (dict(k=X[:1]), r'k must have the \(B, T, H, D\) of q \(2, 70, 2, 64\), got B=1 \(q: 2\)'),
    (dict(v=X[:, :65]), r'v must have .* got T=65 \(q: 70\)'),
    (dict(k=X[:, :, :1]), r'got H=1 \(q: 2\)'),
    (dict(v=X[..., :32]), r'got D=32 \(q: 64\)'),
    (dict(k=X.bfloat16()), r'one dtype, got q torch.float32, k torch.bfloat16'),
    (dict(q=X.double(), k=X.double(), v=X.double()), r'float32, bfloat16 or float16, got torch.float64'),
    (dict(q=X[:, :0], k=X[:, :0], v=X[:, :0]), r'B, T, H, D >= 1'),
    (dict(tau=float('nan')), r'tau must be a finite number >= 0, got nan'),
    (dict(tau=-0.5), r'tau must be a finite number >= 0, got -0.5'),
    (dict(tau=math.inf), r'tau must be a finite number >= 0, got inf'),
    (dict(tau='1'), r"tau must be .* got '1'"),
    (dict(scale=0.0), r'scale must be None or a finite number > 0'),
    (dict(sink_blocks=[2, 1]), r'sink_blocks must be \[start, end\) with 0 <= start <= end, got \[2, 1\]'),
    (dict(sink_q=[0]), r'sink_q must be \[start, end\)'),
    (dict(topk_ratio=1.0), r'topk_ratio must be 0 or in \(0, 1\), got 1.0'),
    (dict(tail=1), r'tail must be a bool'),
    (dict(key_bias=torch.zeros(T + 1)), r'key_bias must be \(T,\), \(B, T\) or \(B\|1, 1, 1, T\) with T=70, B=2 .* got \(71,\)'),
    (dict(key_bias=torch.zeros(B, H, T, T)), r'key_bias must be .*varying over heads or queries.* got \(2, 2, 70, 70\)'),
    (dict(key_bias=torch.zeros(3, T)), r'key_bias must be .* got \(3, 70\)'),
    (dict(key_bias=torch.zeros(T, dtype=torch.int64)), r'key_bias must be bool or float, got torch.int64'),
    (dict(block_len=torch.ones(2)), r'block_len must be int32 of shape \(2,\)'),
    (dict(block_len=torch.ones(3, dtype=torch.int32)), r'block_len must be int32 of shape \(2,\)'),
    (dict(coarse_gate=X[:, :1]), r"coarse_gate must be a float tensor of q's shape \(2, 70, 2, 64\), got \(2, 1, 2, 64\)"),
    (dict(token_aug=32), r'token_aug must be 0 or a multiple of 64 up to 256, got 32'),
    (dict(query_blocks=0), r'query_blocks must be None or an int >= 1, got 0'),
])
def test_bad_input_is_named(kw, match):
    args = dict(q=X, k=X, v=X) | kw
    with pytest.raises(ValueError, match='sol_attention: .*' + match): cq.sol_attention(**args)


def test_options_change_the_result():
    "Each option is live: it changes the output of a call where it matters (so the equality tests are not vacuous)."
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 320, 2, 64, generator=g) for _ in range(3))
    base = cq.sol_attention(q, k, v, tau=1.0)
    for kw in (dict(tau=0.0), dict(scale=0.05), dict(sink_blocks=[0, 1]), dict(sink_q=[2, 3]), dict(topk_ratio=0.5),
               dict(tail=False), dict(block_len=torch.tensor([64, 10, 64, 64, 64], dtype=torch.int32)),
               dict(coarse_gate=torch.ones_like(q)), dict(key_bias=torch.linspace(-2, 0, 320))):
        assert not torch.equal(cq.sol_attention(q, k, v, **kw), base), kw
    assert torch.equal(cq.sol_attention(q, k, v, tau=1.0, token_aug=64), base)   # ignored, as by kitchen's eager
