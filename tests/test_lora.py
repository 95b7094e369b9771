"""LoRAs baked into checkpoints (`merge_loras`, `cquant merge-lora`): every format keeps its format and options, the
bytes are what re-quantizing the float merge gives, a zero LoRA changes nothing, bad input leaves no file."""
import json, math, os, re
import pytest, torch
import cquant as cq
from cquant import lora as lora_mod
from cquant.lora import merge_patch, read_lora
from cquant.modules import requantize_options
from cquant.numerics import unpack_int4
from cquant.tensor import test_bits as check_bits
from test_cli import cquant

# module -> (format, options); None: float. Shapes that every format takes.
PLAN = {'blocks.0.q': ('float8_e4m3fn', {}), 'blocks.0.k': ('nvfp4', {}), 'blocks.0.v': ('mxfp8', {}),
        'blocks.0.o': ('int8_tensorwise', {'convrot': True, 'convrot_groupsize': 64}),
        'blocks.1.q': ('int8_tensorwise', {'per_row': True}), 'blocks.1.k': ('convrot_w4a4', {'convrot_groupsize': 64}),
        'blocks.1.v': ('asym_w4a8_int8', {'group_size': 32}), 'blocks.1.o': ('w6a8_int8', {}),
        'blocks.2.q': ('awq_w4a16', {}), 'blocks.2.k': None}
SMOOTHED, CALIBRATED = 'blocks.0.k', 'blocks.0.q'    # a pre_quant_scale, an input_scale


def float_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {m: (torch.randn(128, 256, generator=g) * 0.05).bfloat16() for m in PLAN}


@pytest.fixture(scope='module')
def base(tmp_path_factory):
    "A checkpoint with one module per format (options set), a smoothed one, a calibrated one and a float one."
    d = tmp_path_factory.mktemp('lora')
    w, sd = float_weights(), {}
    for m, plan in PLAN.items():
        sd[m + '.bias'] = torch.zeros(128, dtype=torch.bfloat16)
        if plan is None: sd[m + '.weight'] = w[m]; continue
        x = w[m].float()
        if m == SMOOTHED:
            s = torch.linspace(0.5, 2.0, 256)
            sd[m + '.pre_quant_scale'] = s.bfloat16(); x = x / s.bfloat16().float()
        qt = cq.quantize(x, plan[0], **plan[1])
        sd.update(qt.state_dict(m + '.')); sd[m + '.comfy_quant'] = cq.encode_json(qt.config)
    sd[CALIBRATED + '.input_scale'] = torch.tensor(0.02)
    cq.save_file(sd, d / 'base.safetensors')
    return d / 'base.safetensors'


def kohya(names, rank=16, scale=0.03, seed=1, dora=False):
    "A kohya LoRA on `names` (rank, alpha = rank / 2), optionally DoRA (per input column)."
    g, out = torch.Generator().manual_seed(seed), {}
    for m in names:
        k = 'lora_unet_' + m.replace('.', '_')
        out[k + '.lora_up.weight'] = torch.randn(128, rank, generator=g) * scale
        out[k + '.lora_down.weight'] = torch.randn(rank, 256, generator=g) * scale
        out[k + '.alpha'] = torch.tensor(rank / 2)
        if dora: out[k + '.dora_scale'] = torch.rand(1, 256, generator=g) + 0.5
    return out


def peft(names, rank=8, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {f'diffusion_model.{m}.lora_{ab}.weight': torch.randn(*(shape), generator=g) * 0.03
            for m in names for ab, shape in (('A', (rank, 256)), ('B', (128, rank)))}


def expected(base_path, lora_sds, strengths):
    "{key: tensor} of each patched module, made by hand: dequantize, merge in the real weight's space, re-quantize."
    out, ck, loras = {}, cq.open_checkpoint(base_path), [read_lora(sd) for sd in lora_sds]
    mods, groups = ck.modules(), ck.groups()
    for m in PLAN:
        e, s = mods[m], (ck[m + '.pre_quant_scale'].float() if m == SMOOTHED else torch.ones(()))
        w = ck.quantized(m, e.shape).dequantize(torch.float32) if e.quantized else ck[m + '.weight']
        merged = w.float() * s
        for patches, st in zip(loras, strengths):
            p = patches.get('lora_unet_' + m.replace('.', '_')) or patches.get(f'diffusion_model.{m}')
            if p is not None: merged = merge_patch(merged, p, st)
        merged = merged / s
        if e.quantized: out.update(cq.quantize(merged, e.format, **requantize_options(ck.quantized(m, e.shape))).state_dict(m + '.'))
        else: out[m + '.weight'] = merged.to(w.dtype)
    ck.close()
    return out


ROTATED = {'blocks.0.o', 'blocks.1.k'}   # merged in their rotated basis: the by-hand route rotates back and forth in fp32

def same_as_by_hand(got, want):
    """Bit for bit, except the ConvRot modules: merged in the basis, they may differ from the by-hand route (which
    rotates back and forth in fp32) by one code step where a value sits on a rounding boundary, in few elements."""
    for k, t in want.items():
        if k.rpartition('.')[0] not in ROTATED: check_bits(got[k], t, k); continue
        if k.endswith('.weight'):
            a, b = (unpack_int4(x) if 'blocks.1.k' in k else x for x in (got[k], t))
            d = (a.int() - b.int()).abs()
            assert d.max() <= 1 and (d > 0).float().mean() < 1e-3, (k, int((d > 0).sum()))
        else: assert torch.allclose(got[k].float(), t.float(), rtol=1e-5, atol=0), k


@pytest.mark.long
def test_every_format_rebaked_in_its_own_format(base, tmp_path):
    l1, l2 = kohya(list(PLAN)), peft(['blocks.0.k', 'blocks.2.k'])
    cq.save_file(l1, tmp_path / 'k.safetensors'); cq.save_file(l2, tmp_path / 'p.safetensors')
    rc, out, err = cquant('merge-lora', base, f'{tmp_path}/k.safetensors:0.8', tmp_path / 'p.safetensors', tmp_path / 'm.safetensors')
    assert rc == 0, err
    assert f"{len(PLAN)} module(s) patched" in out
    slow = re.search(r'^cost: .*; slowest: (\S+) [\d.]+ s', out, re.M)         # what the bake cost (issue 37)
    assert slow and slow.group(1).rstrip(',') in PLAN, out
    assert out.splitlines()[0].split() == ['layer', 'shape', 'format', 'SQNR', 'dB', 'before', 'after', 'reason']
    notes = dict(re.match(r'(\[\d+\]) \d+ layers: (.*)$', l).groups() for l in out.splitlines() if re.match(r'\[\d+\] ', l))
    rows = {l.split()[0]: l for l in out.splitlines()[2:2 + len(PLAN)]}
    why = lambda m: notes.get(rows[m].split()[-1], rows[m])         # a reason three or more rows give is a note [n]
    assert why('blocks.1.v').endswith('k.safetensors x0.8') and why('blocks.0.k').endswith('k.safetensors x0.8, p.safetensors x1')
    got, src = cq.load_file(tmp_path / 'm.safetensors'), cq.load_file(base)
    assert sorted(got) == sorted(src)
    same_as_by_hand(got, expected(base, [l1, l2], [0.8, 1.0]))
    for m in PLAN:                      # comfy_quant, bias, input_scale, pre_quant_scale: the base's
        for s in ('comfy_quant', 'bias', 'input_scale', 'pre_quant_scale'):
            if f'{m}.{s}' in src: check_bits(got[f'{m}.{s}'], src[f'{m}.{s}'], f'{m}.{s}')
    before = {r['module']: (r['format'], r['options']) for r in cq.inspect_checkpoint(base)['modules']}
    assert {r['module']: (r['format'], r['options']) for r in cq.inspect_checkpoint(tmp_path / 'm.safetensors')['modules']} == before
    meta = cq.load_file(tmp_path / 'm.safetensors', with_metadata=True)[1]
    assert [(d['file'], d['strength']) for d in json.loads(meta['cquant_loras'])] == [('k.safetensors', 0.8), ('p.safetensors', 1.0)]
    assert json.loads(meta['cquant_loras'])[0]['sha256'] == cq.sha256_file(tmp_path / 'k.safetensors')


FOUR_BIT = {'nvfp4', 'convrot_w4a4', 'asym_w4a8_int8', 'awq_w4a16'}

def test_merged_model_output_moves_toward_the_float_merge(base, tmp_path):
    """The baked modules compute closer to the float merge than the unpatched base does: by 10 dB or more in the 6- and
    8-bit formats, by 0.5 dB or more in the 4-bit ones, whose grid rounds much of a delta of 14% of the weight away."""
    lora = kohya(list(PLAN), scale=0.06)
    r = cq.merge_loras(base, [lora], tmp_path / 'm.safetensors')
    got, ck = cq.load_file(tmp_path / 'm.safetensors'), cq.open_checkpoint(base)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    for m, (fmt, _) in ((m, p) for m, p in PLAN.items() if p):
        e = ck.modules()[m]
        w0 = ck.quantized(m, e.shape).dequantize(torch.float32)
        s = ck[m + '.pre_quant_scale'].float() if m == SMOOTHED else torch.ones(())
        ref = merge_patch(w0 * s, read_lora(lora)['lora_unet_' + m.replace('.', '_')])
        w1 = cq.load_quantized(got, m, e.shape, torch.float32).dequantize() * s
        gain = cq.sqnr(x @ ref.t(), x @ w1.t()) - cq.sqnr(x @ ref.t(), x @ (w0 * s).t())
        assert gain > (0.5 if fmt in FOUR_BIT else 10), (m, fmt, gain)
        assert next(x for x in r.layers if x['name'] == m)['format'] == fmt
    ck.close()


def test_dora_and_float_base_then_quantize_equals_quantizing_the_float_merge(tmp_path):
    """Merging into a float base, then quantize_checkpoint, is quantize_checkpoint of the float merge made by hand, and so
    is merge_loras with the policy (one pass)."""
    w = float_weights()
    cq.save_file({f'{m}.weight': t for m, t in w.items()}, tmp_path / 'f.safetensors')
    lora = kohya(list(w), dora=True)
    cq.merge_loras(tmp_path / 'f.safetensors', [lora], tmp_path / 'fm.safetensors', strengths=[0.7])
    patches = read_lora(lora)
    hand = {f'{m}.weight': merge_patch(t, patches['lora_unet_' + m.replace('.', '_')], 0.7).bfloat16() for m, t in w.items()}
    cq.save_file(hand, tmp_path / 'hand.safetensors')
    got = cq.load_file(tmp_path / 'fm.safetensors')
    for k, t in hand.items(): check_bits(got[k], t, k)
    pol = cq.Policy(mode='int4_mixed')
    cq.quantize_checkpoint(tmp_path / 'fm.safetensors', tmp_path / 'a.safetensors', pol, progress=False)
    cq.quantize_checkpoint(tmp_path / 'hand.safetensors', tmp_path / 'b.safetensors', pol, progress=False)
    r = cq.merge_loras(tmp_path / 'f.safetensors', [lora], tmp_path / 'c.safetensors', [0.7], pol)   # one pass
    cq.save_file(lora, tmp_path / 'l.safetensors')
    rc, out, err = cquant('merge-lora', tmp_path / 'f.safetensors', f'{tmp_path}/l.safetensors:0.7', tmp_path / 'd.safetensors', '--mode', 'int4_mixed')
    assert rc == 0 and 'W4A4' in out and f'{len(w)} module(s) patched by LoRAs' in out, err
    a, b, c, d = (cq.load_file(tmp_path / f'{n}.safetensors') for n in 'abcd')
    for k in a: check_bits(d[k], b[k], k)
    assert sorted(a) == sorted(b) == sorted(c) and {cq.decode_json(a[k])['format'] for k in a if k.endswith('comfy_quant')} == {'int8_tensorwise', 'convrot_w4a4'}
    for k in a: check_bits(a[k], b[k], k); check_bits(c[k], b[k], k)
    assert r.kind == 'merge' and r.totals['patched'] == sorted(w) and all(x['format'] for x in r.layers)


@pytest.mark.long
def test_reference_reports_what_the_bake_costs(base, tmp_path):
    """With the float original (`--reference`), each module is measured against its own merge, beside quantizing that
    merge directly; the bytes are the bake's, the report and plot are written, and a wrong reference is refused."""
    w = float_weights()
    cq.save_file({**{f'{m}.weight': t for m, t in w.items()}, **{f'{m}.bias': torch.zeros(128, dtype=torch.bfloat16) for m in w}},
                 tmp_path / 'f.safetensors')
    cq.save_file(kohya(list(PLAN), scale=0.06), tmp_path / 'l.safetensors')
    cq.merge_loras(base, [tmp_path / 'l.safetensors'], tmp_path / 'plain.safetensors')
    rc, out, err = cquant('merge-lora', base, tmp_path / 'l.safetensors', tmp_path / 'm.safetensors', '--reference',
                          tmp_path / 'f.safetensors', '--report', tmp_path / 'r.json', '--plot', tmp_path / 'r.png')
    assert rc == 0 and 'direct dB' in out.splitlines()[0], err
    a, b = cq.load_file(tmp_path / 'plain.safetensors'), cq.load_file(tmp_path / 'm.safetensors')
    for k in a: check_bits(b[k], a[k], k)
    rep = cq.Report.load(tmp_path / 'r.json')
    assert rep.kind == 'merge' and (tmp_path / 'r.png').stat().st_size > 10_000
    rows = {x['name']: x for x in rep.layers}
    patches = read_lora(cq.load_file(tmp_path / 'l.safetensors'))
    ck = cq.open_checkpoint(base)
    for m in ('blocks.0.o', 'blocks.1.q', 'blocks.0.v'):          # INT8 ConvRot, INT8 per row, MXFP8
        qt = ck.quantized(m, ck.modules()[m].shape)
        target = merge_patch(w[m], patches['lora_unet_' + m.replace('.', '_')])
        direct = cq.quantize(target, qt.format, **requantize_options(qt)).dequantize(torch.float32)
        assert abs(rows[m]['direct_sqnr_db'] - cq.sqnr(target, direct)) < 1e-3
        assert rows[m]['direct_sqnr_db'] > rows[m]['sqnr_db'] + 1, (m, rows[m])   # 6- and 8-bit: the second rounding shows
    rc, out, err = cquant('merge-lora', base, tmp_path / 'l.safetensors', tmp_path / 'r.safetensors', '--reference',
                          tmp_path / 'f.safetensors', '--from-reference', '--json')
    assert rc == 0, err
    layers = {x['name']: x for x in json.loads(out)['layers']}
    got = cq.load_file(tmp_path / 'r.safetensors')
    for m, (fmt, _) in ((m, p) for m, p in PLAN.items() if p):   # one rounding of the reference's merge, in the base's options
        assert layers[m]['tier'] == 'requantized' and layers[m]['sqnr_db'] == layers[m]['direct_sqnr_db']
        qt = ck.quantized(m, ck.modules()[m].shape)
        s = ck[m + '.pre_quant_scale'].float() if m == SMOOTHED else torch.ones(())
        target = merge_patch(w[m], patches['lora_unet_' + m.replace('.', '_')]) / s
        for k, t in cq.quantize(target, fmt, **requantize_options(qt)).state_dict(m + '.').items(): check_bits(got[k], t, k)
    for k in ('blocks.0.k.pre_quant_scale', 'blocks.0.q.input_scale'): check_bits(got[k], a[k], k)
    ck.close()
    with pytest.raises(ValueError, match="from_reference=True needs reference="):
        cq.merge_loras(base, [tmp_path / 'l.safetensors'], tmp_path / 'x.safetensors', from_reference=True)
    fsd = cq.load_file(tmp_path / 'f.safetensors')
    cq.save_file({**fsd, 'blocks.0.q.weight': torch.zeros(64, 256)}, tmp_path / 'wrong.safetensors')
    cq.save_file({k: v for k, v in fsd.items() if not k.startswith('blocks.1.k.')}, tmp_path / 'lacks.safetensors')
    for ref, msg in (('wrong', r"wrong.safetensors' stores module 'blocks.0.q' as \(64, 256\); expected \(128, 256\), as in the base"),
                     ('lacks', r"lacks.safetensors' has no module 'blocks.1.k'; expected its float weight \(128, 256\)")):
        with pytest.raises(ValueError, match=msg):
            cq.merge_loras(base, [tmp_path / 'l.safetensors'], tmp_path / 'x.safetensors', reference=tmp_path / f'{ref}.safetensors')
    with pytest.raises(ValueError, match="reference= measures a bake into a quantized base"):
        cq.merge_loras(tmp_path / 'f.safetensors', [tmp_path / 'l.safetensors'], tmp_path / 'x.safetensors',
                       policy=cq.Policy(mode='int8'), reference=base)
    assert not (tmp_path / 'x.safetensors').exists()


def test_policy_route_with_calibration(tmp_path):
    """--calibration on the policy route calibrates as quantize_checkpoint does (FP8 input_scale from the layer inputs):
    the bytes of quantizing the float merge with the same calibration; a bake refuses it."""
    w = float_weights()
    cq.save_file({f'{m}.weight': t for m, t in w.items()}, tmp_path / 'f.safetensors')
    cq.save_file(kohya(list(w)), tmp_path / 'l.safetensors')
    g = torch.Generator().manual_seed(5)
    cq.save_file({m: torch.randn(64, 256, generator=g) for m in w}, tmp_path / 'x.safetensors')
    cq.merge_loras(tmp_path / 'f.safetensors', [tmp_path / 'l.safetensors'], tmp_path / 'fm.safetensors')
    pol = cq.Policy(mode='fp8')
    cq.quantize_checkpoint(tmp_path / 'fm.safetensors', tmp_path / 'a.safetensors', pol, progress=False,
                           calibration=tmp_path / 'x.safetensors')
    rc, out, err = cquant('merge-lora', tmp_path / 'f.safetensors', tmp_path / 'l.safetensors', tmp_path / 'b.safetensors',
                          '--mode', 'fp8', '--calibration', tmp_path / 'x.safetensors')
    assert rc == 0, err
    a, b = cq.load_file(tmp_path / 'a.safetensors'), cq.load_file(tmp_path / 'b.safetensors')
    assert sorted(a) == sorted(b) and sum(k.endswith('.input_scale') for k in b) == len(w)
    for k in a: check_bits(b[k], a[k], k)
    with pytest.raises(ValueError, match="calibration= calibrates while quantizing a float base"):
        cq.merge_loras(tmp_path / 'a.safetensors', [tmp_path / 'l.safetensors'], tmp_path / 'c.safetensors',
                       calibration=tmp_path / 'x.safetensors')


def test_zero_lora_keeps_every_byte(base, tmp_path):
    zero = {k: torch.zeros_like(v) if k.endswith('lora_up.weight') else v for k, v in kohya(list(PLAN)).items()}
    r = cq.merge_loras(base, [zero], tmp_path / 'z.safetensors')
    assert len(r.layers) == len(PLAN) and all(x['tier'] == 'unchanged' and x['sqnr_db'] == math.inf for x in r.layers)
    a, b = cq.load_file(base), cq.load_file(tmp_path / 'z.safetensors')
    assert sorted(a) == sorted(b)
    for k in a: check_bits(a[k], b[k], k)


@pytest.mark.long
def test_sharded_base_and_output(base, tmp_path):
    "A sharded folder reads like the file it was cut from; with shard_size (--shard-size) the output is a folder of shards."
    sd = cq.load_file(base)
    with cq.ShardedWriter(tmp_path / 'shards', '100KB', {}) as w:
        for m, keys in cq.group_modules(sd).items():
            w.place(m, sum(sd[k].numel() * sd[k].element_size() for k in keys.values()))
            for k in keys.values(): w.add(k, sd[k])
    assert len(cq.open_checkpoint(tmp_path / 'shards').files) > 1
    lora = kohya(['blocks.0.k', 'blocks.2.k'])
    cq.merge_loras(tmp_path / 'shards', [lora], tmp_path / 'a.safetensors')
    cq.merge_loras(base, [lora], tmp_path / 'b.safetensors')
    a, b = cq.load_file(tmp_path / 'a.safetensors'), cq.load_file(tmp_path / 'b.safetensors')
    for k in a: check_bits(a[k], b[k], k)
    cq.save_file(lora, tmp_path / 'l.safetensors')
    rc, out, err = cquant('merge-lora', tmp_path / 'shards', tmp_path / 'l.safetensors', tmp_path / 'out', '--shard-size', '100KB')
    assert rc == 0, err
    ck = cq.open_checkpoint(tmp_path / 'out')
    assert len(ck.files) > 1 and json.loads(ck.metadata['cquant_loras'])[0]['file'] == 'l.safetensors'
    c = cq.load_file(tmp_path / 'out')
    assert sorted(c) == sorted(b)
    for k in b: check_bits(c[k], b[k], k)
    ck.close()
    f = {f'{m}.weight': t for m, t in float_weights().items()}
    cq.save_file(f, tmp_path / 'f.safetensors')
    pol = cq.Policy(mode='int8')
    cq.merge_loras(tmp_path / 'f.safetensors', [lora], tmp_path / 'd.safetensors', policy=pol)
    cq.merge_loras(tmp_path / 'f.safetensors', [lora], tmp_path / 'dsh', policy=pol, shard_size='20KB')
    d, dsh = cq.load_file(tmp_path / 'd.safetensors'), cq.load_file(tmp_path / 'dsh')
    with cq.open_checkpoint(tmp_path / 'dsh') as sh: assert sorted(d) == sorted(dsh) and len(sh.files) > 1
    for k in d: check_bits(dsh[k], d[k], k)


@pytest.mark.long
@pytest.mark.parametrize('lora, msg', [
    ({'lora_unet_blocks_0_q.lora_up.weight': torch.full((128, 4), float('nan')), 'lora_unet_blocks_0_q.lora_down.weight': torch.ones(4, 256)},
     "'lora_unet_blocks_0_q.lora_up.weight': 512 non-finite value(s)"),
    ({'lora_unet_blocks_0_q.lora_up.weight': torch.ones(128, 4), 'lora_unet_blocks_0_q.lora_down.weight': torch.ones(4, 200)},
     "up (128, 4) @ down (4, 200) is (128, 200), the weight (128, 256) (checkpoint module 'blocks.0.q')"),
    ({'lora_unet_blocks_0_q.lora_up.weight': torch.ones(128, 4), 'lora_unet_blocks_0_q.lora_down.weight': torch.ones(4, 256),
      'diffusion_model.blocks.0.q.lora_B.weight': torch.ones(128, 4), 'diffusion_model.blocks.0.q.lora_A.weight': torch.ones(4, 256)},
     "both patch module 'blocks.0.q'"),
    ({'lora_unet_blocks_0_q.hada_w1_a': torch.ones(128, 4)}, "not supported: LoHa"),
    ({'lora_unet_blocks_9_q.lora_up.weight': torch.ones(128, 4), 'lora_unet_blocks_9_q.lora_down.weight': torch.ones(4, 256)},
     "match no module of the checkpoint, first 'lora_unet_blocks_9_q'; closest modules: ['blocks.2.q', 'blocks.1.q', 'blocks.0.q']"),
])
def test_bad_lora_leaves_no_file(base, tmp_path, lora, msg):
    cq.save_file(lora, tmp_path / 'l.safetensors')
    rc, out, err = cquant('merge-lora', base, tmp_path / 'l.safetensors', tmp_path / 'm.safetensors')
    assert rc == 1 and msg in err, err
    assert not os.path.exists(tmp_path / 'm.safetensors')


@pytest.mark.long
def test_unmatched_allowed_is_counted(base, tmp_path):
    lora = {**kohya(['blocks.0.q']), 'lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight': torch.ones(8, 2),
            'lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight': torch.ones(2, 8)}
    cq.save_file(lora, tmp_path / 'l.safetensors')
    rc, out, err = cquant('merge-lora', base, tmp_path / 'l.safetensors', tmp_path / 'm.safetensors')
    assert rc == 1 and 'a text-encoder LoRA: this checkpoint has no text encoder' in err
    rc, out, err = cquant('merge-lora', base, tmp_path / 'l.safetensors', tmp_path / 'm.safetensors', '--allow-unmatched')
    assert rc == 0 and '1 module(s) patched by LoRAs; 1 LoRA module(s) matched nothing (skipped)' in out
    assert "1 LoRA module(s) match no module of the checkpoint (first 'lora_te1_text_model_encoder_layers_0_mlp_fc1'): skipped" in err


def test_policy_needs_float_modules(base, tmp_path):
    cq.save_file(kohya(['blocks.0.q']), tmp_path / 'l.safetensors')
    with pytest.raises(ValueError, match="with a policy the LoRAs must patch float modules; 1 are stored quantized .first 'blocks.0.q'."):
        cq.merge_loras(base, [tmp_path / 'l.safetensors'], tmp_path / 'm.safetensors', policy=cq.Policy(mode='int8'))
    assert not os.path.exists(tmp_path / 'm.safetensors')


@pytest.mark.writes_invalid
def test_base_neither_float_nor_comfy(tmp_path):
    "FP8 weights with a scale but no comfy_quant (an unknown quantization) are refused before anything is written."
    cq.save_file({'a.weight': torch.randn(128, 256).to(torch.float8_e4m3fn), 'a.weight_scale': torch.tensor(1.0)},
                 tmp_path / 'b.safetensors', validate=False)
    cq.save_file(kohya(['a']), tmp_path / 'l.safetensors')
    with pytest.raises(Exception, match='a.weight_scale'):
        cq.merge_loras(tmp_path / 'b.safetensors', [tmp_path / 'l.safetensors'], tmp_path / 'm.safetensors')
    assert not os.path.exists(tmp_path / 'm.safetensors')


def test_mxfp8_bakes_in_row_blocks_with_its_padding(tmp_path):
    """An MXFP8 module of 1120 rows bakes in row blocks of whole scale tiles (1024 rows, then 96 whose scale tile is padded
    to 128): the bytes of re-quantizing the merge whole. (A file's MXFP8 rows count its padding to 32: the loader cannot
    tell padded rows from real ones.)"""
    g = torch.Generator().manual_seed(3)
    qt = cq.quantize((torch.randn(1120, 256, generator=g) * 0.05).bfloat16(), 'mxfp8')
    cq.save_file({**qt.state_dict('m.'), 'm.comfy_quant': cq.encode_json(qt.config)}, tmp_path / 'b.safetensors')
    lora = {'lora_unet_m.lora_up.weight': torch.randn(1120, 8, generator=g) * 0.03,
            'lora_unet_m.lora_down.weight': torch.randn(8, 256, generator=g) * 0.03, 'lora_unet_m.alpha': torch.tensor(4.0)}
    cq.save_file(lora, tmp_path / 'l.safetensors')
    cuts, real = [], lora_mod._stored_rows
    def spy(qt, how):
        rows = real(qt, how)
        return lambda i, j: (cuts.append((i, j)), rows(i, j))[1]
    lora_mod._stored_rows = spy
    try: cq.merge_loras(tmp_path / 'b.safetensors', [tmp_path / 'l.safetensors'], tmp_path / 'm.safetensors')
    finally: lora_mod._stored_rows = real
    assert cuts == [(0, 1024), (1024, 1120)]
    merged = merge_patch(qt.dequantize(torch.float32), read_lora(lora)['lora_unet_m'], 1.0)
    got = cq.load_file(tmp_path / 'm.safetensors')
    for k, t in cq.quantize(merged, 'mxfp8').state_dict('m.').items(): check_bits(got[k], t, k)
