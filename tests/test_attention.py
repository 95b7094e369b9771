"""Attention preferences end to end: files written with `cquant attention set`, listed with `cquant attention`, loaded
into models whose attention follows them (`ComfyAttention`), saved back unchanged."""
import json, os
import pytest
import torch

import cquant as cq
from cquant.attention import attention_report, set_attention
from test_cli import cquant

PREF = [{'attention': 'comfy_kitchen_sol', 'tau': 1.5}, {'attention': 'comfy_kitchen_int8'}]


@pytest.fixture(scope='module')
def dit(tmp_path_factory):
    "A bf16 DiT with head dim 128 (2 heads of dim 256): SOL's rule holds for its attention calls."
    p = tmp_path_factory.mktemp('attn') / 'dit.safetensors'
    cq.save_file(cq.dit_state_dict(0, torch.bfloat16, heads=2), p)
    return p


@pytest.mark.long
def test_cli_set_then_list(dit, tmp_path):
    dst = tmp_path / 'pref.safetensors'
    rc, out, err = cquant('attention', 'set', dit, dst, '--module', 'blocks.*.attn', '--prefer',
                          'comfy_kitchen_sol:tau=1.5,comfy_kitchen_int8', '--module', 'blocks.0.attn', '--prefer', 'none')
    assert rc == 0, err
    assert 'blocks.0.attn: removed' in out and f'wrote {dst}' in out
    rc, out, err = cquant('attention', dst, '--json', '--device', 'cpu')
    rows = json.loads(out)
    assert [r['module'] for r in rows] == ['blocks.1.attn', 'blocks.2.attn', 'blocks.3.attn']
    assert all(r['stored'] == PREF and r['cquant'] == 'comfy_kitchen_sol (reference)' for r in rows)
    rc, out, _ = cquant('attention', dst, '--device', 'cpu')
    assert rc == 0 and 'blocks.3.attn' in out and "SOL's rule" in out
    assert out.splitlines()[0].split() == ['module', 'stored', 'preferences', 'cquant', 'runs', 'ComfyUI', 'runs']   # a table, not a list
    other = {k: v for k, v in cq.load_file(dit).items()}
    got = cq.load_file(dst)
    assert sorted(set(got) - set(other)) == [f'blocks.{i}.attn.comfy_attention.config' for i in (1, 2, 3)]
    assert all(torch.equal(got[k], other[k]) for k in other)


@pytest.mark.parametrize('argv, msg', [
    (['set', 'DIT', 'X', '--module', 'blocks.*.atn', '--prefer', 'comfy_kitchen_sol'], "names no module of the file"),
    (['set', 'DIT', 'X', '--module', 'blocks.*.attn', '--prefer', 'comfy_kitchen_sol:tau=0'], "expected a finite number > 0"),
    (['set', 'DIT', 'X', '--module', 'blocks.*.attn'], "usage: cquant attention set"),
    (['DIT', 'extra'], "usage: cquant attention FILE"),
])
def test_cli_errors(dit, tmp_path, argv, msg):
    argv = [str(dit) if a == 'DIT' else str(tmp_path / 'x.safetensors') if a == 'X' else a for a in argv]
    rc, out, err = cquant('attention', *argv)
    assert rc == 1 and msg in err, err
    assert not (tmp_path / 'x.safetensors').exists()


@pytest.mark.long
def test_unknown_methods_are_listed_and_kept(dit, tmp_path):
    dst = tmp_path / 'u.safetensors'
    cfg = [{'attention': 'flash_v9'}, {'attention': 'comfy_kitchen_int8'}]
    set_attention(dit, dst, {'blocks.1.attn': cfg})
    (row,) = attention_report(dst, 'cpu')
    assert row['unknown'] == ['flash_v9'] and row['cquant'] == 'comfy_kitchen_int8 (reference)'
    rc, out, err = cquant('attention', dst, '--device', 'cpu')
    assert "unknown attention methods ['flash_v9']" in out


def test_model_follows_the_file_and_saves_it_back(dit, tmp_path):
    "Each block's attention runs the stored method; saving writes the stored lists back byte for byte."
    dst = tmp_path / 'pref.safetensors'
    set_attention(dit, dst, {'blocks.*.attn': PREF})
    sd = cq.load_file(dst)
    with pytest.warns(cq.CheckpointWarning, match="unsupported attention method 'flash_v9'"):
        sd['blocks.2.attn.comfy_attention.config'] = cq.encode_json([{'attention': 'flash_v9'}] + PREF)
        model = cq.load_quantized_model(cq.dit_model(heads=2), sd).bfloat16()
    x, t, y = cq.dit_batches(1, tokens=256, dtype=torch.bfloat16)[0]
    model(x, t, y)
    assert [b.attn.comfy_attention.last.method for b in model.blocks] == ['comfy_kitchen_sol'] * 4
    assert [b.attn.comfy_attention.last.options for b in model.blocks] == [(('tau', 1.5),)] * 4
    back = model.state_dict()
    for k in (k for k in sd if k.endswith('comfy_attention.config')): assert torch.equal(back[k], sd[k]), k
    model(x[:, :100], t, y)                                # a ragged length: still SOL (its rule is dtype and head dim)
    assert model.blocks[0].attn.comfy_attention.last.method == 'comfy_kitchen_sol'
    model.float()(x.float(), t, y)                         # float32 Q/K/V: outside SOL's rule, exact attention
    assert {b.attn.comfy_attention.last.reason for b in model.blocks} == {'SOL needs matching fp16/bf16 Q/K/V with head dim 128'}


def test_minilm_without_padding_follows_preferences():
    "MiniLM's attention takes preferences; a padded batch is a masked call (exact), an unpadded one is not."
    m = cq.MiniLM(vocab=64, d=64, ff=128, layers=2, heads=4).eval()
    sd = {**m.state_dict(), 'encoder.layer.0.attention.comfy_attention.config': cq.encode_json([PREF[1]])}
    m = cq.load_quantized_model(cq.MiniLM(vocab=64, d=64, ff=128, layers=2, heads=4).eval(), sd)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    a = m.encoder.layer[0].attention.comfy_attention
    m.bfloat16()(ids)
    assert a.last.method == 'comfy_kitchen_int8'
    mask = torch.ones_like(ids, dtype=torch.bool); mask[1, 30:] = False
    m(ids, mask)
    assert (a.last.method, a.last.reason) == ('exact', 'masked call')
