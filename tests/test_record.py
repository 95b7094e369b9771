"""Recorded calibration (issue 43): the recorder against the rows it saw, the file and its validation, merging (also
across a two-process gloo group), and every data-aware method from statistics through the file and the CLI."""
import json, os, subprocess, sys, warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import cquant as cq
from cquant.checkpoint import load_file, save_file
from cquant.models import dit_model, dit_batches, dit_state_dict
from cquant.policy import PolicyWarning
from cquant.record import unpack_upper
from conftest import ROOT, cquant_cli



class Tiny(nn.Module):
    "Two layers fed the same tensor (shared statistics), one after a nonlinearity, one on a per-sample vector."
    def __init__(self, K=64, N=96):
        super().__init__()
        self.q, self.k, self.up = nn.Linear(K, N), nn.Linear(K, N), nn.Linear(N, K)
        self.mod = nn.Linear(K, K)
    def forward(self, x):                      # x [B, T, K]
        h = self.q(x) + self.k(x)
        return self.up(torch.relu(h)) + self.mod(x.mean(1))[:, None]


def tiny_batches(n=5, B=3, T=7, K=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(B, T, K, generator=g) * torch.linspace(0.2, 3, K)
        m = torch.rand(B, T, generator=g) > 0.3
        out.append((x, m))
    return out


@pytest.fixture(scope='module')
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


def rows_of(model, batches, name, masked):
    "The exact rows `name` saw (masked positions only where asked), by a plain hook."
    seen = []
    h = dict(model.named_modules())[name].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        for x, m in batches:
            n0 = len(seen); model(x)
            seen[n0:] = [t[m] if masked and t.shape[:-1] == m.shape else t.reshape(-1, t.shape[-1]) for t in seen[n0:]]
    h.remove()
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in seen]).double()


def test_recorder_matches_the_rows_it_saw(tiny):
    b = tiny_batches()
    st = cq.record_calibration(tiny, b, run=lambda m, bt: m(bt[0]), mask=lambda bt: bt[1], hessian_dtype=torch.float64)
    assert list(st) == ['q', 'k', 'up', 'mod'] and st.shared == {'k': 'q'}
    assert st.meta['masked'] == {'q': True, 'up': True, 'mod': False}
    for n in ('q', 'up', 'mod'):
        x = rows_of(tiny, b, n, masked=n != 'mod')
        s = st[n]
        assert s.count == x.shape[0]
        torch.testing.assert_close(s.gram(), x.T @ x, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(s.mean_abs(), x.abs().mean(0).float())
        assert torch.equal(s.channel_amax, x.abs().amax(0).float())
        assert s.act.count == x.numel() and s.rows.shape == (min(512, x.shape[0]), x.shape[1])
    assert st['k'] is st['q']


def test_passes_give_the_same_statistics(tiny):
    b = tiny_batches()
    run, mask = (lambda m, bt: m(bt[0])), (lambda bt: bt[1])
    one = cq.record_calibration(tiny, b, run=run, mask=mask)
    need = cq.stats_bytes(96)
    several = cq.record_calibration(tiny, b, run=run, mask=mask, memory=need + 1)
    assert several.meta['passes'] == 3 and several.shared == one.shared     # q (k shares it), up, mod
    for n in one:
        assert torch.equal(several[n].gram(), one[n].gram()) and torch.equal(several[n].rows, one[n].rows)
    with pytest.raises(MemoryError, match=r"layer 'up' alone needs .* more than the memory budget"):
        cq.record_calibration(tiny, b, run=run, memory=need - 1)
    with pytest.raises(TypeError, match='one-shot iterator'):
        cq.record_calibration(tiny, iter(b), run=run, memory=need + 1)
    again = cq.record_calibration(tiny, lambda: iter(b), run=run, mask=mask, memory=need + 1)    # a function: fresh each pass
    assert torch.equal(again['up'].gram(), one['up'].gram())


def test_shared_inputs_are_checked_on_every_batch(tiny):
    class Sometimes(Tiny):
        calls = 0
        def forward(self, x):
            Sometimes.calls += 1
            h = self.q(x) + self.k(x if Sometimes.calls == 1 else x.clone())
            return self.up(torch.relu(h))
    m = Sometimes().eval()
    with pytest.raises(RuntimeError, match="layer 'k' shared the input tensor of 'q' in the first batch but not"):
        cq.record_calibration(m, tiny_batches(2), run=lambda m, bt: m(bt[0]))


def test_non_finite_inputs_name_the_layer(tiny):
    x = torch.randn(2, 3, 64); x[0, 1, 5] = float('inf')
    with pytest.raises(ValueError, match="layer 'q' received a non-finite input"):
        cq.record_calibration(tiny, [x])


def test_file_round_trip_shards_and_merge(tiny, tmp_path):
    b = tiny_batches(6)
    run, mask = (lambda m, bt: m(bt[0])), (lambda bt: bt[1])
    st = cq.record_calibration(tiny, b, run=run, mask=mask, rows=16)
    for path in (st.save(tmp_path / 'one.safetensors'), st.save(tmp_path / 'shards', shard_size='40KB')):
        back = cq.load_calibration(path)
        assert list(back) == list(st) and back.shared == st.shared and back.meta['masked'] == st.meta['masked']
        for n in st:
            for f in ('rows', 'abs_sum', 'channel_amax', 'keys'): assert torch.equal(getattr(back[n], f), getattr(st[n], f))
            assert torch.equal(back[n].gram(), st[n].gram()) and back[n].count == st[n].count
            assert torch.equal(back[n].act.hist, st[n].act.hist) and back[n].act.zeros == st[n].act.zeros
    assert len([f for f in os.listdir(tmp_path / 'shards') if f.endswith('.safetensors')]) > 1
    merged = cq.record_calibration(tiny, b[:2], run=run, mask=mask, rows=16)
    merged += cq.load_calibration(cq.record_calibration(tiny, b[2:], run=run, mask=mask, rows=16, seed=1).save(tmp_path / 'b.st'))
    for n in ('q', 'up'):
        assert merged[n].count == st[n].count and torch.equal(merged[n].act.hist, st[n].act.hist)
        torch.testing.assert_close(merged[n].gram(), st[n].gram(), rtol=1e-5, atol=1e-4)
        assert merged[n].rows.shape == (16, st.K(n))
    assert merged.meta['batches'] == 6


def _broken(path, tmp_path, change, meta=None):
    sd, m = load_file(path, with_metadata=True, validate=False)
    change(sd)
    p = tmp_path / 'broken.safetensors'
    save_file(sd, p, metadata=m if meta is None else meta, validate=False)
    return p


def test_validation_names_the_layer_and_key(tiny, tmp_path):
    st = cq.record_calibration(tiny, tiny_batches(2), run=lambda m, bt: m(bt[0]))
    path = st.save(tmp_path / 'ok.safetensors')
    def nan(sd): sd['up.hessian'] = sd['up.hessian'].clone(); sd['up.hessian'][3] = float('nan')
    with pytest.raises(cq.CalibrationError, match=r"layer 'up': 'up.hessian': expected finite values, found 1 NaN/inf"):
        cq.load_calibration(_broken(path, tmp_path, nan))['up'].gram()
    def shape(sd): sd['q.abs_sum'] = sd['q.abs_sum'][:10]
    with pytest.raises(cq.CalibrationError, match=r"layer 'q': 'q.abs_sum': expected shape \(64,\) \(K=64\), found \(10,\)"):
        cq.load_calibration(_broken(path, tmp_path, shape))
    def asym(sd): H = unpack_upper(sd['up.hessian'], 96); H[0, 5] += 1; sd['up.hessian'] = H
    with pytest.raises(cq.CalibrationError, match="'up.hessian': expected a symmetric matrix"):
        cq.load_calibration(_broken(path, tmp_path, asym))['up'].gram()
    def sym(sd): sd['up.hessian'] = unpack_upper(sd['up.hessian'], 96)         # a full symmetric matrix is accepted
    assert torch.equal(cq.load_calibration(_broken(path, tmp_path, sym))['up'].gram(), st['up'].gram())
    def gone(sd): del sd['mod.keys']
    with pytest.raises(cq.CalibrationError, match="layer 'mod': expected the tensor 'mod.keys', found none"):
        cq.load_calibration(_broken(path, tmp_path, gone))
    with pytest.raises(cq.CalibrationError, match='expected a cquant statistics file'):
        cq.load_calibration(_broken(path, tmp_path, lambda sd: None, meta={}))
    shapes = {'model.q': (96, 64), 'model.k': (96, 64), 'model.up': (64, 96), 'model.mod': (64, 64)}
    m = cq.load_calibration(path).matched(shapes, 'ck.safetensors')
    assert list(m) == list(shapes) and torch.equal(m['model.k'].gram(), st['q'].gram())
    with pytest.raises(cq.CalibrationError, match=r"ck.safetensors: layer 'up': recorded with K=96 inputs, but the weight "
                                                  r"'model.up' \(64, 48\) has K=48"):
        cq.load_calibration(path).matched({**shapes, 'model.up': (64, 48)}, 'ck.safetensors')
    with pytest.raises(cq.CalibrationError, match="layer 'mod': recorded, but ck.safetensors has no layer 'model.mod'"):
        cq.load_calibration(path).matched({k: v for k, v in shapes.items() if k != 'model.mod'}, 'ck.safetensors')


def test_hessian_rows_share_through_the_file(tiny, tmp_path):
    "hessian_rows=p: Σxᵀx over a seeded share of the rows, counted, saved, merged, validated, and what GPTQ divides by."
    b = tiny_batches(8, B=4, T=256)
    run, mask = (lambda m, bt: m(bt[0])), (lambda bt: bt[1])
    full = cq.record_calibration(tiny, b, run=run, mask=mask, hessian_dtype=torch.float64)
    part = cq.record_calibration(tiny, b, run=run, mask=mask, hessian_dtype=torch.float64, hessian_rows=0.5)
    back = cq.load_calibration(part.save(tmp_path / 'part.safetensors'))
    assert back.meta['hessian_rows'] == 0.5
    for n in ('q', 'up'):
        f, p, r = full[n], part[n], back[n]
        assert p.count == f.count and 0.35 * f.count < p.hessian_count < 0.65 * f.count and f.hessian_count == f.count
        assert r.hessian_count == p.hessian_count and torch.equal(r.gram(), p.gram())
        assert torch.equal(p.act.hist, f.act.hist) and torch.equal(p.abs_sum, f.abs_sum)   # the rest sees every row
        Hf, Hp = f.gram() / f.count, p.gram() / p.hessian_count                     # the same Hessian, estimated
        assert float((Hp - Hf).norm() / Hf.norm()) < 0.15                    # measured 0.081 (q), 0.034 (up)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter('error')                                   # enough rows: no fallback warning
        q = cq.quantize(w, 'convrot_w4a4', convrot_groupsize=64, rounding='gptq', calibration=back['q'])
    x = rows_of(tiny, b, 'q', True).float()
    near = cq.quantize(w, 'convrot_w4a4', convrot_groupsize=64)
    err = lambda t: float((x @ (t.dequantize(torch.float32) - w).T).square().sum())
    assert err(q) < 0.8 * err(near)                                      # measured 0.60
    merged = cq.record_calibration(tiny, b[:4], run=run, mask=mask, hessian_rows=0.5)
    other = cq.record_calibration(tiny, b[4:], run=run, mask=mask, hessian_rows=0.5, seed=1)
    before = merged['q'].hessian_count
    merged += other
    assert merged['q'].hessian_count == before + other['q'].hessian_count
    _, m = load_file(back.where, with_metadata=True, validate=False)
    h = json.loads(m['cquant_calibration']); h['layers']['q']['hessian_count'] = h['layers']['q']['count'] + 1
    with pytest.raises(cq.CalibrationError, match=r"layer 'q': expected a Hessian row count between 0 and the \d+ rows"):
        cq.load_calibration(_broken(back.where, tmp_path, lambda sd: None, meta={**m, 'cquant_calibration': json.dumps(h)}))
    with pytest.raises(ValueError, match=r"hessian_rows: expected the share of rows .* in \(0, 1\], got 1.5"):
        cq.record_calibration(tiny, b, run=run, hessian_rows=1.5)


def test_gptq_awq_svdquant_from_statistics():
    "The same codes as from the rows that made the statistics (up to the accumulation's rounding)."
    torch.manual_seed(0)
    K, N = 256, 128
    x = torch.randn(3000, K) * torch.linspace(0.1, 3, K); x[:, 3] *= 15
    w = torch.randn(N, K)
    s = cq.LayerStats(K, 600, torch.float64)
    for i in range(0, 3000, 512): s.update(x[i:i + 512])
    for fmt, o in [('int8_tensorwise', dict(per_row=True)), ('nvfp4', {}), ('convrot_w4a4', {}),
                   ('int8_tensorwise', dict(convrot=True))]:
        a = cq.quantize(w, fmt, rounding='gptq', calibration=x, **o)
        b = cq.quantize(w, fmt, rounding='gptq', calibration=s, **o)
        same = float((a.qdata == b.qdata).float().mean())
        assert same >= (1.0 if fmt != 'int8_tensorwise' or not o.get('convrot') else 0.999), (fmt, o, same)
    a, b = cq.quantize(w, 'awq_w4a16', calibration=x), cq.quantize(w, 'awq_w4a16', calibration=s)
    assert torch.equal(a.qdata, b.qdata)
    y = x @ w.T
    q = cq.quantize(w, 'svdquant_w4a4', calibration=s)                     # the searches run on the reservoir
    assert cq.sqnr(y, torch.nn.functional.linear(x, q)) > 15
    with pytest.raises(cq.QuantFormatError, match=r"expected statistics of inputs \[\.\.\., 128\] \(the weight has K=128\), "
                                                  r"found statistics of K=256"):
        cq.quantize(w[:, :128], 'int8_tensorwise', per_row=True, rounding='gptq', calibration=s)


@pytest.mark.long
def test_quantize_checkpoint_and_cli_take_a_recorded_file(tmp_path):
    "A DiT recorded in Python, its checkpoint under a prefix: GPTQ from the file beats nearest on held-out output."
    model = dit_model(0, depth=2)
    st = cq.record_calibration(model, dit_batches(4, seed=1))
    cal = st.save(tmp_path / 'dit.calibration.safetensors')
    sd = {'model.diffusion_model.' + k: v.to(torch.bfloat16) for k, v in dit_state_dict(0, depth=2).items()}
    src = tmp_path / 'dit.safetensors'
    save_file(sd, src)
    pol = cq.Policy(mode='int4_full', rounding='gptq', keep_float=('moe.',))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        rep = cq.quantize_checkpoint(src, tmp_path / 'gptq.safetensors', pol, progress=False, calibration=cal)
        cq.quantize_checkpoint(src, tmp_path / 'near.safetensors', cq.Policy(mode='int4_full', keep_float=('moe.',)),
                               progress=False)
    assert {r['rounding'] for r in rep.layers if r.get('format')} == {'gptq'}
    held = dit_batches(2, seed=2)
    def out(path):
        m = dit_model(0, depth=2)
        q = cq.load_file(path)
        m = cq.load_quantized_model(m, {k[len('model.diffusion_model.'):]: v for k, v in q.items()})
        with torch.no_grad(): return torch.cat([m(*b).flatten() for b in held])
    with torch.no_grad(): ref = torch.cat([model(*b).flatten() for b in held])
    gain = cq.sqnr(ref, out(tmp_path / 'gptq.safetensors')) - cq.sqnr(ref, out(tmp_path / 'near.safetensors'))
    assert gain > 1.0, gain
    rc, _, err = cquant_cli('quantize', src, tmp_path / 'cli.safetensors', '--mode', 'int4_full', '--rounding', 'gptq',
                            '--keep-float', 'moe.', '--calibration', cal, '--quiet')
    assert rc == 0, err
    a, b = cq.load_file(tmp_path / 'cli.safetensors'), cq.load_file(tmp_path / 'gptq.safetensors')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = cq.record_calibration(dit_model(0, depth=2, dim=128, heads=2), dit_batches(1, seed=1)).save(tmp_path / 'other.st')
    rc, _, err = cquant_cli('quantize', src, tmp_path / 'x.safetensors', '--rounding', 'gptq', '--calibration', other, '--quiet')
    assert rc != 0 and "recorded with K=128 inputs, but the weight" in err, err
    assert not (tmp_path / 'x.safetensors').exists()
    out = cquant_cli('quantize', '--help')[1]
    assert 'cq.record_calibration(pipe.transformer' in out and 'untested' in out and 'sensitivity=True' in out


@pytest.mark.long
def test_measured_selection_from_a_file_with_sensitivity(tmp_path):
    "int4_mixed measured selection through the CLI from a file with output sensitivity: the API's plan, its reasons."
    model = dit_model(0, depth=2)
    cal = cq.record_calibration(model, dit_batches(4, seed=1), sensitivity=True).save(tmp_path / 'dit.calibration.safetensors')
    src = tmp_path / 'dit.safetensors'
    save_file({k: v.to(torch.bfloat16) for k, v in dit_state_dict(0, depth=2).items()}, src)
    pol = cq.Policy(mode='int4_mixed', selection='measured', int4_mixed_ratio=0.5, keep_float=('moe.',))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        plan = pol.plan(src, cq.load_calibration(cal))
    chosen = plan.selected()
    assert 0 < len(chosen) < plan.budget['candidates']
    assert all('model output (Hessian, sensitivity) SQNR' in plan[n].reason for n in plan.budget['order'])
    rc, _, err = cquant_cli('quantize', src, tmp_path / 'out.safetensors', '--mode', 'int4_mixed', '--selection', 'measured',
                            '--ratio', '0.5', '--keep-float', 'moe.', '--calibration', cal, '--quiet', '--json')
    assert rc == 0, err
    with cq.open_checkpoint(tmp_path / 'out.safetensors') as ck: fmts = {m: i.format for m, i in ck.modules().items()}
    assert {n: fmts.get(n) for n in plan.budget['order']} == {n: plan[n].format for n in plan.budget['order']}


WORKER = r'''
import os, sys, torch, torch.distributed as dist
import cquant as cq
sys.path.insert(0, os.environ['TESTS'])
from test_record import Tiny, tiny_batches
rank = int(sys.argv[1])
dist.init_process_group('gloo', init_method='file://' + sys.argv[2], rank=rank, world_size=2)
torch.manual_seed(0)
model = Tiny().eval()
b = tiny_batches(6)
st = cq.record_calibration(model, b[rank::2], run=lambda m, bt: m(bt[0]), mask=lambda bt: bt[1], rows=8, seed=rank,
                           hessian_dtype=torch.float64, sensitivity=True)
st.all_reduce()
if rank == 0: st.save(sys.argv[3])
dist.destroy_process_group()
'''


@pytest.mark.long
def test_all_reduce_in_a_two_process_gloo_group(tmp_path):
    "Each rank records half the batches; the reduced statistics equal one recording of all of them."
    script = tmp_path / 'worker.py'
    script.write_text(WORKER)
    env = {**os.environ, 'TESTS': str(Path(__file__).parent), 'PYTHONPATH': str(ROOT)}
    init, out = tmp_path / 'init', tmp_path / 'reduced.safetensors'
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(init), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    torch.manual_seed(0)
    one = cq.record_calibration(Tiny().eval(), tiny_batches(6), run=lambda m, bt: m(bt[0]), mask=lambda bt: bt[1], rows=8,
                                hessian_dtype=torch.float64)
    red = cq.load_calibration(out)
    assert red.meta['batches'] == 6 and red.shared == one.shared
    for n in one:
        assert red[n].count == one[n].count and red[n].act.zeros == one[n].act.zeros
        torch.testing.assert_close(red[n].gram(), one[n].gram(), rtol=1e-12, atol=1e-9)
        assert torch.equal(red[n].act.hist, one[n].act.hist) and torch.equal(red[n].channel_amax, one[n].channel_amax)
        assert red[n].rows.shape == one[n].rows.shape == (8, one.K(n))
        ks = red[n].keys
        assert bool((ks[1:] >= ks[:-1]).all())               # the smallest keys of both ranks, in order
    run, mask = lambda m, bt: m(bt[0]), lambda bt: bt[1]
    torch.manual_seed(0)
    model = Tiny().eval()
    halves = [cq.record_calibration(model, tiny_batches(6)[r::2], run=run, mask=mask, rows=8, seed=r,
                                    sensitivity=True) for r in (0, 1)]     # each rank's own projections
    for n in one:
        s, a, b = red.sensitivity(n), halves[0].sensitivity(n), halves[1].sensitivity(n)
        torch.testing.assert_close(s.grad_sq, a.grad_sq + b.grad_sq, rtol=1e-12, atol=0)
        assert s.rows == a.rows + b.rows and abs(s.energy - (a.energy + b.energy)) <= 1e-9 * s.energy


def test_moe_bank_experts_split_over_passes():
    "A bank's experts planned into several passes record what one pass records; each expert only its routed rows."
    from cquant.models import MOE_DIT, moe_dit_model
    from cquant.record import stats_bytes
    model, b = moe_dit_model(0), dit_batches(6, seed=1, classes=MOE_DIT['classes'])
    one = cq.record_calibration(model, b, layers='moe.*', hessian_dtype=torch.float64)
    several = cq.record_calibration(model, b, layers='moe.*', hessian_dtype=torch.float64, memory=2 * stats_bytes(256, 512, torch.float64))
    assert several.meta['passes'] >= 4 and list(several) == list(one)
    for n in one:
        assert several[n].count == one[n].count
        torch.testing.assert_close(several[n].gram(), one[n].gram(), rtol=1e-12, atol=0)
    assert sum(one[cq.expert_key('moe.down', e)].count for e in range(4)) == one['moe.gate'].count
    with pytest.raises(TypeError, match="MoE bank 'moe.up' was called with int"):
        cq.record_calibration(model, [5], run=lambda m, x: m.moe.up(x, torch.zeros(1, dtype=torch.long)), layers='moe.up')
