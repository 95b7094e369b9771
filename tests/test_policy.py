"""Policies: the nested INT8 budget (published behaviour + hypothesis nesting), presets, auto-detection,
mode fallbacks asked of the registry, plan inputs, measured selection, JSON round trip."""
import json, math, os, warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import cquant as cq
from cquant.policy import (AUTO_GROUPS, NO_DATA, greedy_order, grouped, plan_ratios)
from cquant.policy import (CHOICES, CONSERVATIVE, MODES, PRESETS, Policy, PolicyWarning, budget_order, budget_target,
                           detect_preset, int8_budget, krea2_names, layer_source, natural_key, spread)
from cquant.models import dit_batches, dit_model, dit_state_dict
from cquant.calibrate import collect_inputs

TEN = [f'layer.{i}' for i in range(10)]
KREA_SENS = PRESETS['krea2'].int4_sensitive


# --- the published behaviour of the nested budget (policies.md §1.5) ---

def test_ten_plain_layers():
    assert [int(n.split('.')[1]) for n, _ in budget_order(TEN)] == [7, 2, 9, 4, 1, 6, 0, 5, 3, 8]
    assert int8_budget(TEN, 0.2) == ['layer.2', 'layer.7']
    assert int8_budget(TEN, 0.1) == ['layer.7']
    assert int8_budget(TEN, 0.3) == ['layer.2', 'layer.7', 'layer.9']
    assert int8_budget(TEN, 0.5) == ['layer.1', 'layer.2', 'layer.4', 'layer.7', 'layer.9']
    assert int8_budget(TEN, 0.0) == [] and int8_budget(TEN, 1.0) == TEN


def test_krea2_shaped_model():
    krea = krea2_names()
    assert len(krea) == 224
    k25 = int8_budget(krea, 0.25, KREA_SENS)
    assert len(k25) == 56 and set(k25) == {n for n in krea if n.endswith(('attn.wo', 'mlp.down'))}
    k20 = int8_budget(krea, 0.2, KREA_SENS)
    assert len(k20) == 45 and all(n.endswith(('attn.wo', 'mlp.down')) for n in k20)
    assert {int(n.split('.')[1]) for n in k20} == set(range(28))
    assert [int(n.split('.')[1]) for n in int8_budget(krea, 0.05, KREA_SENS)] == [0, 2, 4, 7, 9, 12, 14, 17, 19, 22, 24, 27]


def test_krea2_through_a_policy():
    shapes = {n: (3072, 3072) for n in krea2_names()}
    shapes.update({'first.proj': (3072, 256), 'tmlp.0': (3072, 256), 'tproj': (3072, 3072), 'txtfusion.0': (3072, 4096)})
    plan = Policy(int4_mixed_ratio=0.25).plan(shapes)
    assert plan.preset == 'krea2'
    assert set(plan.selected()) == {n for n in krea2_names() if n.endswith(('attn.wo', 'mlp.down'))}
    assert plan.counts() == {'INT8 ConvRot': 56, 'W4A4': 168, 'float': 4}
    assert plan['blocks.0.attn.wo'].config == {'format': 'int8_tensorwise', 'convrot': True, 'convrot_groupsize': 256}
    assert plan['blocks.0.attn.wq'].config == {'format': 'convrot_w4a4', 'convrot_groupsize': 256}


def test_anima_and_small_priority_cases():
    anima = [f'blocks.{b}.{s}' for b in range(28) for s in ('self_attn.q', 'self_attn.k', 'self_attn.v', 'self_attn.output_proj',
             'cross_attn.q', 'cross_attn.kv', 'cross_attn.output_proj', 'mlp.layer1', 'mlp.layer2', 'adaln_modulation')]
    sel = int8_budget(anima, 0.3, PRESETS['anima'].int4_sensitive)
    assert len(sel) == 84 and all(any(p in n for p in PRESETS['anima'].int4_sensitive) for n in sel)
    five = [f'layer.{i}' for i in range(5)]
    assert int8_budget(five, 0.4, ['layer.4']) == ['layer.3', 'layer.4']
    assert int8_budget(TEN, 0.37) == int8_budget(list(TEN), 0.37)


# --- nesting: every pair of ratios, any names, any priority set ---

@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 300), data=st.data())
def test_profiles_nest(n, data):
    names = [f'blocks.{i}.lin' for i in range(n)]
    prio = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n, unique=True)) if n else []
    pri_names = {names[i] for i in prio}
    names = [nm + ('.hot' if nm in pri_names else '') for nm in names]
    r1 = data.draw(st.floats(0, 1)); r2 = data.draw(st.floats(0, 1))
    lo, hi = sorted((r1, r2))
    a, b = set(int8_budget(names, lo, ['.hot'])), set(int8_budget(names, hi, ['.hot']))
    assert a <= b
    assert len(b) == budget_target(n, hi)
    # priority first above the anchor ratio: at a ratio that covers all priority layers, all are in
    if budget_target(n, hi) >= len(pri_names) and hi >= 0.2: assert {nm for nm in names if nm.endswith('.hot')} <= b


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 500), data=st.data())
def test_spread_picks_distinct_midpoints(L, data):
    k = data.draw(st.integers(0, L))
    picks = spread(range(L), k)
    assert len(picks) == len(set(picks)) == k and picks == sorted(picks)
    assert all(p == math.floor((i + 0.5) * L / k) for i, p in enumerate(picks))


# --- presets and auto-detection ---

def test_preset_patterns_exact():
    assert PRESETS['flux2'].keep_float == ('img_in', 'time_in', 'guidance_in', 'txt_in', 'final_layer', 'double_stream_modulation_img',
                                            'double_stream_modulation_txt', 'single_stream_modulation')
    assert PRESETS['flux2_fast_unsafe'].keep_float == tuple(p for p in PRESETS['flux2'].keep_float if p != 'final_layer')
    assert PRESETS['z-image'].keep_float == ('cap_embedder', 't_embedder', 'x_embedder', 'cap_pad_token', 'context_refiner',
                                             'final_layer', 'noise_refiner', 'adaLN', 'x_pad_token', 'layers.0.')
    assert PRESETS['wan'].keep_float[-4:] == ('face_adapter', 'face_encoder', 'motion_encoder', 'pose_patch_embedding')
    assert PRESETS['minimax_h3'].int4_sensitive == ('attn.out_proj', 'mlp.fc2')
    assert PRESETS['sdxl'].keep_float == ('time_embed', 'label_emb', 'emb_layers', 'proj_in', 'proj_out')
    assert PRESETS['qwen'].keep_float == ('time_text_embed', 'img_in', 'norm_out', 'proj_out', 'txt_in')
    assert PRESETS['hidream o1'].keep_float == ('embed', 'language_model.layers.35.mlp')
    assert PRESETS['none'].keep_float == () and PRESETS['none'].int4_sensitive == ()
    allkeep = [p for s in PRESETS.values() for p in s.keep_float]
    assert list(CONSERVATIVE.keep_float) == list(dict.fromkeys(allkeep))


def test_substring_matching_quirks():
    plan = Policy('int8', 'z-image').plan({'layers.0.attn': (64, 64), 'layers.01.attn': (64, 64), 'xlayers.0.attn': (64, 64)})
    assert [plan[n].format for n in ('layers.0.attn', 'layers.01.attn', 'xlayers.0.attn')] == [None, 'int8_tensorwise', None]


@pytest.mark.parametrize('names,expect', [
    (['double_blocks.0.img_attn', 'guidance_in.in_layer', 'img_in', 'single_blocks.0'], 'flux2'),
    (['video_patch_proj', 'audio_patch_proj', 'blocks.0.attn.out_proj'], 'minimax_h3'),
    (['cap_embedder.0', 'context_refiner.0', 'noise_refiner.0', 'layers.0.attention'], 'z-image'),
    (['patch_embedding', 'time_projection.1', 'blocks.0.self_attn.q'], 'wan'),
    (['audio_adaln_single.linear', 'audio_caption_projection.linear_1', 'transformer_blocks.0'], 'ltx2'),
    (['language_model.layers.0.mlp', 'embed_tokens'], 'hidream o1'),
    (['embed_image_indicator', 't_embedding.0'], 'ideogram4'),
    (['double_stream_layers.0', 'img_instruct_attn', 'norm_out'], 'boogu'),
    (['distilled_guidance_layer.in_proj', 'nerf_blocks.0'], 'chroma'),
    (['text_proj', 'x_embedder', 'time_embed'], 'ernie'),
    (['llm_adapter.blocks.0', 'x_embedder', 'blocks.0.adaln_modulation_self_attn'], 'anima'),
    (['encoder.layer.0.attention.self.query'], None),
])
def test_auto_detection(names, expect):
    assert detect_preset(names)[0] == expect


def test_sdxl_rule_and_unknown_warning():
    assert detect_preset(['label_emb.0.0', 'input_blocks.0'], {'label_emb.0.0': (1280, 2816)})[0] == 'sdxl'
    assert Policy().plan({'label_emb.0.0': (1280, 2816), 'input_blocks.1.1.proj_in': (640, 640)}).preset == 'sdxl'
    with pytest.warns(PolicyWarning, match='no architecture recognised'):
        plan = Policy().plan({'foo.bar': (64, 256)})
    assert plan.preset == 'auto-conservative' and plan.keep_float == list(CONSERVATIVE.keep_float)


# --- modes, eligibility, fallbacks asked of the registry ---

MINI = {f'encoder.layer.{i}.{s}': shape for i in range(6) for s, shape in
        [('attention.self.query', (384, 384)), ('intermediate.dense', (1536, 384)), ('output.dense', (384, 1536))]}


def test_modes_and_fallbacks():
    counts = lambda mode, **kw: Policy(mode, 'none', **kw).plan(MINI).counts()
    assert counts('int8') == {'INT8': 18}
    assert counts('int8_convrot') == {'INT8 ConvRot': 6, 'INT8': 12}
    assert counts('int4_mixed') == {'INT8': 12, 'INT8 ConvRot': 2, 'W4A4': 4}
    assert counts('int4_full', int4_sensitive=('output',)) == {'INT8': 12, 'W4A4': 6}
    assert counts('fp8') == {'FP8': 18} and counts('nvfp4') == {'NVFP4': 18} and counts('mxfp8') == {'MXFP8': 18}
    d = Policy('int8_convrot', 'none').plan(MINI)['encoder.layer.0.attention.self.query']
    assert (d.format, d.options, d.tier) == ('int8_tensorwise', {'per_row': True}, 'fallback')
    assert "INT8 ConvRot does not fit: ConvRot group 256 does not divide K=384; convrot_groupsize='auto' " \
           "(--convrot-groupsize auto) fits 64" in d.reason        # said for planning, with what would fit
    d = Policy('int8_convrot', 'none').plan({'odd': (16, 102)})['odd']       # no power of 4 divides 102: the registry's
    assert d.format == 'int8_tensorwise' and "expected a power of 4" in d.reason and 'auto' not in d.reason


def test_w4a8_mode():
    plan = lambda: Policy('w4a8', 'none').plan({'a': (64, 512), 'b': (64, 384)})
    if 'asym_w4a8_int8' not in cq.FORMATS:
        with pytest.raises(ValueError, match="W4A8 needs format 'asym_w4a8_int8', which is not registered"): plan()
        return
    p = plan()
    assert p['a'].format == 'asym_w4a8_int8' and p['a'].config['group_size'] == 16 and p['a'].config['convrot_groupsize'] == 256
    assert (p['b'].format, p['b'].tier) == ('int8_tensorwise', 'fallback')


def test_eligibility():
    sd = {'a.weight': torch.zeros(8, 256), 'n.weight': torch.ones(8), 'e.weight': torch.zeros(100, 1),
          'i.weight': torch.zeros(4, 4, dtype=torch.int32), 'b.weight': torch.zeros(4, 4, 4),
          'q.weight': cq.quantize(torch.randn(16, 256), 'float8_e4m3fn'), 'f8.weight': torch.zeros(16, 256, dtype=torch.float8_e5m2),
          'keep.weight': torch.zeros(8, 256)}
    plan = Policy('int8', 'none', keep_float=('keep',)).plan(sd)
    assert {k: d.tier for k, d in plan.items()} == {'a': 'mode', 'n': 'ineligible', 'e': 'ineligible', 'i': 'ineligible',
                                                   'b': 'ineligible', 'q': 'mode', 'f8': 'mode', 'keep': 'keep_float'}
    m = torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.Embedding(10, 256), torch.nn.LayerNorm(8))
    mp = Policy('int8', 'none').plan(m)
    assert mp['0'].format == 'int8_tensorwise' and mp['1'].reason == 'not a Linear (Embedding)'


def test_plan_inputs_agree(tmp_path):
    sd = dit_state_dict(0, depth=2, experts=2)
    f = tmp_path / 'dit.safetensors'
    cq.save_file(sd, f)
    pol = Policy(preset='none', keep_float=('embed', 'adaLN', 'final_layer'))
    fmts = lambda p: {k: (d.format, d.config) for k, d in p.items() if d.format}
    a = pol.plan(sd)
    b = pol.plan(str(f))
    c = pol.plan(dit_model(0, depth=2, experts=2))
    d = pol.plan({k[:-7]: tuple(v.shape) for k, v in sd.items() if k.endswith('.weight') and v.dim() == 2})
    assert fmts(a) == fmts(c) == fmts(d)                      # model order
    assert list(b) == sorted(b, key=natural_key)              # a file: natural name order (its own order is dtype, name)
    assert fmts(b) == fmts(pol.plan({k: sd[k] for k in sorted(sd, key=natural_key)}))
    assert {k for k, v in fmts(a).items()} == {k for k, v in fmts(b).items()}


def test_overrides():
    plan = Policy('int4_mixed', 'none', overrides=[('layer.5.output', None), ('query', 'int8_tensorwise', {'per_row': False})]).plan(MINI)
    assert plan['encoder.layer.5.output.dense'].tier == 'override' and plan['encoder.layer.5.output.dense'].format is None
    assert plan['encoder.layer.0.attention.self.query'].options == {'per_row': False}
    with pytest.raises(ValueError, match="asks for convrot_w4a4"):
        Policy('int8', 'none', overrides=[('query', 'convrot_w4a4')]).plan(MINI)


# --- measured selection ---

def test_measured_without_data_is_structural():
    sd = dit_state_dict(0, depth=2, experts=2)
    for r in (0.1, 0.2, 0.5):
        m = Policy(selection='measured', preset='auto-conservative', int4_mixed_ratio=r).plan(sd)
        s = Policy(preset='auto-conservative', int4_mixed_ratio=r).plan(sd)
        assert m.selected() == s.selected() and m.budget['note'] == NO_DATA
        assert all(d.reason.startswith('int4_mixed: ') and NO_DATA in d.reason for n, d in m.items() if n in m.budget['order'])


def test_measured_with_inputs_is_optimal_per_layer():
    model = dit_model(0, depth=2, experts=2)
    ins = collect_inputs(model, dit_batches(1))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        plans = {r: Policy(selection='measured', int4_mixed_ratio=r).plan(model.state_dict(), calibration=ins)
                 for r in (0.1, 0.2, 0.4)}
    meas = plans[0.2].budget['measurements']
    total = lambda chosen: sum(e['high'] if n in chosen else e['low'] for n, e in meas.items())
    assert set(plans[0.1].selected()) <= set(plans[0.2].selected()) <= set(plans[0.4].selected())
    gains = sorted((e['low'] - e['high'] for e in meas.values()), reverse=True)
    k = len(plans[0.2].selected())
    assert math.isclose(sum(e['low'] for e in meas.values()) - sum(gains[:k]), total(set(plans[0.2].selected())), rel_tol=1e-12)
    assert 'measured rank 1/' in plans[0.2][plans[0.2].budget['order'][0]].reason


def test_measured_with_model_is_greedy_and_nested():
    model = dit_model(0, depth=2, experts=2)
    cal = dit_batches(1, tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        ps = plan_ratios(Policy(selection='measured'), model, (0.1, 0.2, 0.5), cal)
        one = Policy(selection='measured', int4_mixed_ratio=0.2).plan(model, calibration=cal)
    g = ps[0.5].budget['greedy']
    assert sorted(g['order']) == sorted(ps[0.5].budget['order']) and len(g['order']) == ps[0.5].budget['candidates']
    for r in (0.1, 0.2, 0.5):
        assert ps[r].budget['order'] == g['order'] and set(ps[r].selected()) == set(g['order'][:ps[r].budget['target']])
    assert set(ps[0.1].selected()) <= set(ps[0.2].selected()) <= set(ps[0.5].selected())
    assert one.selected() == ps[0.2].selected() and one.budget['greedy']['order'] == g['order']
    first = ps[0.5][g['order'][0]].reason
    assert (f"end-to-end rank 1/{ps[0.5].budget['candidates']} (backward elimination; calibration output SQNR "
            f"{g['start_db']:.2f} -> {g['sqnr_db'][0]:.2f} dB with it)") in first
    rest = [n for n in ps[0.2].budget['order'] if n not in ps[0.2].selected()]
    assert 'outside the INT8 budget (end-to-end rank' in ps[0.2][rest[0]].reason
    # the first move of the elimination is the cheapest one from all-INT8 (checked by brute force with quantize_model)
    fixed = {n: d for n, d in ps[0.5].items() if d.format is not None and n not in ps[0.5].budget['order']}
    mode = MODES['int4_mixed']
    pairs = {n: (mode.chain[0], mode.budget[0]) for n in ps[0.5].budget['order']}
    with torch.no_grad():
        ref = torch.cat([model(*b).flatten() for b in cal])
        def moved_low(c):
            plan = {**{n: (d.format, d.options) for n, d in fixed.items()},
                    **{n: ((lo if n == c else hi).format, (lo if n == c else hi).opts) for n, (lo, hi) in pairs.items()}}
            q = cq.quantize_model(dit_model(0, depth=2, experts=2), plan)
            return cq.sqnr(ref, torch.cat([q(*b).flatten() for b in cal]))
        sc = {c: moved_low(c) for c in pairs}
    assert max(sc, key=sc.get) == g['order'][-1]
    assert abs(sc[g['order'][-1]] - g['sqnr_db'][-2]) < 1e-3
    assert greedy_order(model, cal, pairs, fixed)['order'] == g['order']
    with pytest.raises(TypeError, match='must return a tensor'):
        greedy_order(model, cal, pairs, fixed, outputs=lambda m, b: {'x': m(*b)})
    with pytest.raises(ValueError, match='needs the weights'):
        Policy(selection='measured', preset='none').plan(MINI, calibration={})
    assert Policy(selection='measured', preset='none').plan(MINI).budget['note'] == NO_DATA   # shapes: structural


# --- plain data ---

names = st.text(alphabet='abcdefghij._0123456789', min_size=1, max_size=12)

@settings(max_examples=80, deadline=None)
@given(mode=st.sampled_from(list(MODES)), preset=st.sampled_from(sorted(PRESETS) + ['auto', 'auto-conservative']),
       ratio=st.floats(0, 1), keep=st.lists(names, max_size=4), sens=st.lists(names, max_size=3),
       sel=st.sampled_from(['structural', 'measured']),
       ov=st.lists(st.tuples(names, st.sampled_from([None, 'int8_tensorwise']), st.just({})), max_size=2),
       group=st.sampled_from([4, 16, 64, 256, 1024, 'auto']))
def test_policy_json_round_trip(mode, preset, ratio, keep, sens, sel, ov, group):
    p = Policy(mode, preset, ratio, keep, sens, sel, ov, group)
    q = Policy.from_json(p.to_json())
    assert q == p and hash(q) == hash(p) and json.loads(q.to_json()) == json.loads(p.to_json())


def test_policy_validation():
    with pytest.raises(ValueError, match='Policy.mode'): Policy('int5')
    with pytest.raises(ValueError, match='Policy.preset'): Policy(preset='flux3')
    with pytest.raises(ValueError, match=r'\[0, 1\]'): Policy(int4_mixed_ratio=-0.1)
    with pytest.raises(ValueError, match='unknown field'): Policy.from_dict({'mode': 'int8', 'foo': 1})
    assert Policy(preset='Z_Image').preset == 'z-image' and Policy(preset='hidream').preset == 'hidream o1'


@pytest.mark.parametrize('bad', [128, 0, 1, 2, -4, 4.0, True, '64', 'Auto', None])
def test_bad_convrot_groupsize(bad):
    with pytest.raises(ValueError, match=r"Policy.convrot_groupsize: expected 'auto' or a power of 4"):
        Policy(convrot_groupsize=bad)
    with pytest.raises(ValueError, match='Policy.convrot_groupsize'):
        Policy.from_dict({'convrot_groupsize': bad})


@pytest.mark.parametrize('K, group', [(1536, 256), (384, 64), (768, 256), (320, 64), (192, 64), (4096, 256)])
def test_auto_group_per_layer(K, group):
    p = Policy('int4_mixed', 'none', 0.0, convrot_groupsize='auto').plan({'a': (128, K), 'b': (128, 1536)})
    assert p['a'].label == 'W4A4' and p['a'].config['convrot_groupsize'] == group
    assert p['b'].config['convrot_groupsize'] == 256
    assert f"W4A4 (ConvRot group {group})" in p['a'].reason
    assert p.to_dict()['policy']['convrot_groupsize'] == 'auto'


def test_auto_group_int8_convrot_and_fallback():
    # K = 48: W4A4 needs K % 64 == 0 (the registry says so); INT8 ConvRot takes group 16
    p = Policy('int8_convrot', 'none', convrot_groupsize='auto').plan({'a': (64, 48), 'b': (64, 42)})
    assert p['a'].config == {'format': 'int8_tensorwise', 'convrot': True, 'convrot_groupsize': 16}
    assert p['b'].label == 'INT8' and p['b'].tier == 'fallback' and 'INT8 ConvRot (ConvRot group 256) does not fit' in p['b'].reason
    q = Policy('int4_full', 'none', convrot_groupsize='auto').plan({'a': (64, 48)})
    assert q['a'].label == 'INT8' and q['a'].tier == 'fallback'
    assert grouped(CHOICES['W4A4'], (64, 48), 'a', 'auto').check((64, 48)) is not None
    assert AUTO_GROUPS[0] == 256
    # a fixed group other than the default is stated too
    r = Policy('int4_full', 'none', convrot_groupsize=64).plan({'a': (64, 1536)})
    assert r['a'].config['convrot_groupsize'] == 64 and 'W4A4 (ConvRot group 64)' in r['a'].reason


def test_weight_only_preset_layers_get_awq():
    "A preset's weight_only layers get AWQ W4A16 in the 4-bit modes only, with the reason; the shape rule still holds."
    sd = {'blocks.0.img_mod.1.weight': torch.zeros(768, 384), 'blocks.0.txt_mod.1.weight': torch.zeros(768, 100),
          'blocks.0.attn.to_q.weight': torch.zeros(512, 512), 'time_text_embed.l.weight': torch.zeros(64, 64)}
    awq = cq.FORMATS['awq_w4a16'].name
    p = Policy(preset='qwen', mode='int4_full').plan(sd)
    assert p['blocks.0.img_mod.1'].format == awq and p['blocks.0.img_mod.1'].options == {'group_size': 64}
    assert "weight_only pattern 'img_mod' (preset qwen)" in p['blocks.0.img_mod.1'].reason
    assert p['blocks.0.txt_mod.1'].format != awq and 'AWQ W4A16 does not fit' in p['blocks.0.txt_mod.1'].reason
    assert p['blocks.0.attn.to_q'].format == 'convrot_w4a4' and p['time_text_embed.l'].format is None
    assert Policy(preset='qwen', mode='int8').plan(sd)['blocks.0.img_mod.1'].format == 'int8_tensorwise'
    assert Policy(preset='flux2', mode='int4_full').plan(sd)['blocks.0.img_mod.1'].format == 'int8_tensorwise'  # K=384
    assert set(PRESETS['qwen'].weight_only) <= set(CONSERVATIVE.weight_only)


@pytest.mark.long
def test_svdquant_mode_and_rank():
    "mode='svdquant': SVDQuant W4A4 where K % 64 == 0 and the rank fits, else per-row INT8; the rank a policy setting."
    sd = {'a.weight': torch.zeros(256, 512), 'b.weight': torch.zeros(8, 100), 'c.weight': torch.zeros(16, 128)}
    svdq = cq.FORMATS['svdquant_w4a4'].name
    p = Policy(mode='svdquant', preset='none').plan(sd)
    assert [p[n].format for n in 'abc'] == [svdq, 'int8_tensorwise', svdq] and p['a'].options == {}
    assert 'SVDQuant W4A4 does not fit: weight: K=100' in p['b'].reason
    r = Policy(mode='svdquant', preset='none', svdquant_rank=64).plan(sd)
    assert r['a'].options == {'rank': 64} and r['c'].format == 'int8_tensorwise' and 'rank=64' in r['c'].reason
    assert Policy.from_json(Policy(mode='svdquant', svdquant_rank=16).to_json()).svdquant_rank == 16
    for bad in (0, 1.5, True, '32'):
        with pytest.raises(ValueError, match='Policy.svdquant_rank: expected None or a positive int'):
            Policy(svdquant_rank=bad)
    model, cal, held = dit_model(0, depth=2, experts=2), dit_batches(2, tokens=32, seed=1), dit_batches(1, tokens=32, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        qs = {m: cq.quantize_model(dit_model(0, depth=2, experts=2), Policy(mode=m).plan(model), calibration=cal)
              for m in ('svdquant', 'int4_full')}
    assert any(getattr(q.weight, 'format', None) == svdq for q in qs['svdquant'].modules() if hasattr(q, 'weight'))
    with torch.no_grad():
        ref = torch.cat([model(*b).flatten() for b in held])
        got = {m: cq.sqnr(ref, torch.cat([q(*b).flatten() for b in held])) for m, q in qs.items()}
    assert got['svdquant'] > got['int4_full'] + 2, got        # measured +2.7 dB here, +7.1 dB on the 4-block DiT (07b)


# --- one answer per layer: a model and its checkpoint file ---

def _same(a, b) -> dict:
    "The layers both plans hold on which (format, config, reason) differ."
    key = lambda d: (d.format, d.config, d.reason)
    return {n: (key(a[n]), key(b[n])) for n in a if n in b and key(a[n]) != key(b[n])}


def test_embedding_tables_by_source():
    "An nn.Embedding and a bias-free state-dict entry named like one are both 'not a Linear (Embedding)'; shapes come first."
    from cquant.policy import embedding_table, ineligible
    assert embedding_table('embeddings.word_embeddings') and embedding_table('y_embed') and embedding_table('model.embed_tokens')
    assert not embedding_table('patch_embed', ('weight', 'bias')) and not embedding_table('t_embed.mlp.0')
    assert not embedding_table('x_embedder') and not embedding_table('pooler.dense')
    m = torch.nn.ModuleDict(dict(word_embeddings=torch.nn.Embedding(10, 256), norm=torch.nn.LayerNorm(256),
                                 proj=torch.nn.Linear(256, 256)))
    pol = Policy('int8', 'none')
    a, b = pol.plan(m), pol.plan(m.state_dict())
    assert _same(a, b) == {} and list(a) == list(b)
    assert a['word_embeddings'].reason == 'not a Linear (Embedding)' and a['norm'].reason == 'not a 2-D weight (shape (256,))'
    assert a['proj'].format == 'int8_tensorwise'


@pytest.mark.parametrize('mode', ['int4_mixed', 'int8', 'int4_full'])
@pytest.mark.parametrize('preset', ['auto', 'none'])
def test_minilm_model_and_file_agree(mode, preset):
    "Every layer MiniLM's model and its file share gets one decision; pooler.dense is only in the file and takes no budget."
    from cquant.minilm import minilm_path
    path = minilm_path()
    if path is None or not os.path.exists(path): pytest.skip('MiniLM weights not available (cquant fetch-minilm)')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        pm, pf = Policy(mode, preset).plan(cq.minilm_model()), Policy(mode, preset).plan(path)
    assert _same(pm, pf) == {}
    assert set(pf) - set(pm) == {'pooler.dense'} and set(pm) <= set(pf)
    assert pf['pooler.dense'].label == 'INT8'
    for n in ('word_embeddings', 'position_embeddings', 'token_type_embeddings'):
        assert pf['embeddings.' + n].format is None and pf['embeddings.' + n].reason == 'not a Linear (Embedding)'
    assert (pm.budget['candidates'], pm.budget['target'], pm.selected()) == \
           (pf.budget['candidates'], pf.budget['target'], pf.selected())
    if mode == 'int4_mixed': assert pf.budget['candidates'] == 6 and len(pf.selected()) == 2


def test_minilm_auto_groups_budget_differs_for_stated_reasons():
    "With convrot_groupsize='auto' the file has one more candidate (pooler.dense) and its own (natural name) order."
    from cquant.minilm import minilm_path
    path = minilm_path()
    if path is None or not os.path.exists(path): pytest.skip('MiniLM weights not available (cquant fetch-minilm)')
    pol, model = Policy(preset='none', convrot_groupsize='auto'), cq.minilm_model()
    pm, pf = pol.plan(model), pol.plan(path)
    assert (pm.budget['candidates'], pf.budget['candidates']) == (36, 37)
    assert pm.budget['target'] == pf.budget['target'] == 8
    assert set(pm.budget['order']) == set(pf.budget['order']) - {'pooler.dense'}
    assert _same(pol.plan(model.state_dict()), pm) == {}          # model order and the same candidates: the same plan


@pytest.mark.long
def test_measured_selection_leaves_padding_out():
    "Issue 43: with `mask`, the end-to-end ranking compares real tokens only; padded MiniLM positions moved its choice."
    from cquant.minilm import minilm_path, sentence_batches
    from cquant.evaluate import CALIBRATION_SENTENCES
    if minilm_path() is None: pytest.skip('MiniLM weights not available (cquant fetch-minilm)')
    model, batches = cq.minilm_model(), sentence_batches(CALIBRATION_SENTENCES[:40])
    pol = Policy(mode='int4_mixed', selection='measured')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        plan = pol.plan(model, batches, mask=lambda b: b[1])
        assert sorted(plan.budget['chosen']) == ['encoder.layer.4.output.dense', 'encoder.layer.5.output.dense']
        with pytest.raises(ValueError, match=r"mask\(batch\) has shape \(3, \d+\), which does not cover the output's leading"):
            pol.plan(model, batches[:1], mask=lambda b: b[1][:3])
