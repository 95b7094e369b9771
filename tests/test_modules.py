"""The module layer (cquant.modules, nbs/12_modules.ipynb) on a DiT-shaped model with all eight formats.

- A small DiT-shaped reference model (`moe_dit_model`: cquant.policy's `dit_model` at dim 128 with its MoE on
  expert banks; attention, MLP, adaLN, timestep MLP, class embedding, random weights with outlier channels) is
  quantized per module with a mix of all eight formats, saved with `cq.save_file` (validated), loaded with
  `cq.load_file` into a fresh model: outputs bit-identical, the re-saved state dict byte-identical.
- Output SQNR against the float model, per format (every module that fits in that format) and for the mix,
  at least the bound measured on this code minus 0.5 dB (`SQNR_DB`).
- The saved state dict dequantizes module by module (each expert of a bank, each embedding row) in comfy-kitchen
  0.2.40 to exactly the weights the modules report.
- Embedding lookups equal dequantize-then-index and never decode the table (a spy on the layout).
- Expert-bank outputs: each routed row equals its expert's own linear; full precision equals `F.linear` on that
  expert's dequantized weight, decoding that expert only; close to the float reference.
- LoRA patch: deterministic per key, same format and options; unpatch restores the bits exactly.
- Disabled formats / full_precision_matrix_mult: exactly `F.linear` on the dequantized weight, and within a
  measured SQNR of the emulated quantized kernel (`FALLBACK_DB`).

Small matrices on a loaded 2-core CPU: torch's two OpenMP threads cost more than they bring, so this module runs
single-threaded (the values do not depend on it).
"""
from __future__ import annotations
import contextlib, os, types
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cquant as cq
from cquant.comfy import FPMM, dequantize_rows
from cquant.modules import (QuantModule, QuantLinear, QuantEmbedding, QuantMoEExperts, load_quantized_model,
                            uniform_plan, set_quant_compute, apply_lora, unpatch, lora_delta, string_to_seed,
                            comfy_disabled_formats, LoadKeysError, LoadKeysWarning)
from cquant.tensor import QuantizedTensor, same_bits, test_bits as assert_bits   # alias: pytest would collect test_bits
from cquant.numerics import sqnr
from cquant.policy import Policy
from cquant.calibrate import quantize_model
from cquant.models import MOE_DIT, dit_batches, moe_dit_model

ALL8 = ('float8_e4m3fn', 'float8_e5m2', 'nvfp4', 'mxfp8', 'int8_tensorwise', 'convrot_w4a4', 'asym_w4a8_int8', 'w6a8_int8')

MIXED_PLAN = {
    'patch_embed': 'float8_e5m2',
    't_embed.mlp.0': 'mxfp8',
    't_embed.mlp.2': 'nvfp4',
    'y_embed': ('int8_tensorwise', dict(convrot=True, convrot_groupsize=16)),
    'blocks.0.adaLN_modulation.1': 'float8_e4m3fn',
    'blocks.0.attn.qkv': ('convrot_w4a4', dict(convrot_groupsize=64)),
    'blocks.0.attn.proj': ('asym_w4a8_int8', dict(group_size=16, convrot_groupsize=64)),
    'blocks.0.mlp.fc1': ('w6a8_int8', dict(group_size=32, convrot_groupsize=64)),
    'blocks.0.mlp.fc2': ('int8_tensorwise', dict(convrot=True, convrot_groupsize=256)),
    'blocks.1.adaLN_modulation.1': ('int8_tensorwise', dict(per_row=True)),
    'blocks.1.attn.qkv': 'nvfp4',
    'blocks.1.attn.proj': 'mxfp8',
    'blocks.1.mlp.fc1': ('convrot_w4a4', dict(convrot_groupsize=64, linear_dtype='int8')),
    'blocks.1.mlp.fc2': ('asym_w4a8_int8', dict(group_size=16, convrot_groupsize=256)),
    'moe.up': ('asym_w4a8_int8', dict(group_size=16, convrot_groupsize=64)),
    'moe.down': ('w6a8_int8', dict(group_size=16, convrot_groupsize=256)),
    'final_layer.adaLN_modulation.1': ('float8_e4m3fn', {FPMM: True}),
}
ACT_FP8, ACT_NVFP4 = 'blocks.0.adaLN_modulation.1', 't_embed.mlp.2'   # modules that get an input_scale / pre_quant_scale

# One variant per format for the per-format sweep: every Linear, Embedding and bank the format accepts.
SWEEP = {
    'float8_e4m3fn': {}, 'float8_e5m2': {}, 'nvfp4': {}, 'mxfp8': {}, 'int8_tensorwise': dict(per_row=True),
    'convrot_w4a4': dict(convrot_groupsize=64), 'asym_w4a8_int8': dict(group_size=16, convrot_groupsize=64),
    'w6a8_int8': dict(group_size=32, convrot_groupsize=64),
}
# Output SQNR (dB) of the quantized model against the float model on `dit_batches(1, tokens=32, classes=64)`:
# the values measured on this code, asserted with 0.5 dB of slack.
SQNR_DB = {'mixed': 8.01, 'float8_e4m3fn': 16.42, 'float8_e5m2': 10.63, 'nvfp4': 5.21, 'mxfp8': 18.09, 'int8_tensorwise': 18.15,
           'convrot_w4a4': 6.58, 'asym_w4a8_int8': 14.73, 'w6a8_int8': 21.92}
# One Linear (K=128, N=64): SQNR (dB) between the dequantized fallback and the format's emulated kernel
# (the cost of the kernel's activation quantization), measured, asserted with 0.5 dB of slack.
FALLBACK_DB = {'float8_e4m3fn': 31.54, 'float8_e5m2': 25.55, 'nvfp4': 20.29, 'mxfp8': 31.53, 'int8_tensorwise': 43.83,
               'convrot_w4a4': 18.71, 'asym_w4a8_int8': 43.78, 'w6a8_int8': 43.77}
# The mixed model: every module dequantized vs the formats' kernels; computed in bf16 vs fp32 (measured).
DEQUANT_VS_KERNEL_DB, BF16_VS_FP32_DB = 10.24, 13.73
SLACK = 0.5


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_all_formats_registered():
    missing = [f for f in ALL8 if f not in cq.FORMATS]
    assert not missing, f"formats {missing} are not registered (have {sorted(cq.FORMATS)})"


def inputs():
    return dit_batches(1, tokens=32, classes=MOE_DIT['classes'])[0]


def run(model, xb):
    with torch.no_grad(): return model(*xb)


def add_activation_tensors(model, xb):
    "An FP8 input_scale and NVFP4 smoothing (pre_quant_scale + input_scale), calibrated on `xb` with hooks."
    seen = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].detach().clone()))
             for n in (ACT_FP8, ACT_NVFP4)]
    run(model, xb)
    for h in hooks: h.remove()
    return seen


@pytest.fixture(scope='module')
def mixed(tmp_path_factory):
    "The mixed-format model, its float reference, the saved file and the reloaded model."
    for f in ALL8:
        if f not in cq.FORMATS: pytest.fail(f"format {f!r} is not registered")
    xb = inputs()
    float_model = moe_dit_model(0)
    ref = run(float_model, xb)
    model = moe_dit_model(0)
    acts = add_activation_tensors(model, xb)
    # NVFP4 smoothing: the weight carries 1/s per input column, the module multiplies x by s first
    s = acts[ACT_NVFP4].abs().amax(0).clamp_min(1e-3).sqrt()
    with torch.no_grad(): model.get_submodule(ACT_NVFP4).weight.mul_(s)
    quantize_model(model, MIXED_PLAN)
    m = model.get_submodule(ACT_NVFP4)
    m.pre_quant_scale = 1 / s
    m.input_scale = (acts[ACT_NVFP4] / s).abs().amax() / (448 * 6)
    model.get_submodule(ACT_FP8).input_scale = acts[ACT_FP8].abs().amax() / 448      # the Linear's input (after SiLU)
    out = run(model, xb)
    path = str(tmp_path_factory.mktemp('modules') / 'dit.safetensors')
    sd = model.state_dict()
    cq.save_file(sd, path)
    loaded = cq.load_file(path)
    fresh = moe_dit_model(1)
    assert load_quantized_model(fresh, loaded) is fresh
    return types.SimpleNamespace(xb=xb, ref=ref, model=model, out=out, sd=sd, path=path, loaded=loaded, fresh=fresh, res=fresh.load_result)


# ------------------------------------------------------------------------------------------------ round trip
def test_round_trip_identical(mixed):
    assert (mixed.res.missing_keys, mixed.res.unexpected_keys) == ([], [])
    assert_bits(run(mixed.fresh, mixed.xb), mixed.out, 'reloaded model output')
    formats = {m.format for m in mixed.fresh.modules() if isinstance(m, QuantModule)} - {None}
    assert formats == set(ALL8)
    again = mixed.fresh.state_dict()
    assert sorted(again) == sorted(mixed.loaded)
    for k, v in mixed.loaded.items(): assert_bits(again[k], v, f're-saved {k}')
    for k in ('input_scale', 'pre_quant_scale'): assert ACT_NVFP4 + '.' + k in mixed.loaded
    assert ACT_FP8 + '.input_scale' in mixed.loaded
    assert cq.decode_json(mixed.loaded['final_layer.adaLN_modulation.1.comfy_quant']) == {'format': 'float8_e4m3fn', FPMM: True}
    up = cq.decode_json(mixed.loaded['moe.up.comfy_quant'])
    assert (up['format'], up['num_experts'], up['group_size'], up['convrot_groupsize']) == ('asym_w4a8_int8', 4, 16, 64)
    assert mixed.loaded['moe.up.weight'].shape[0] == 4 * 256                      # grouped bank stored flattened, E*N rows


def test_checkpoint_is_valid(mixed):
    with cq.open_checkpoint(mixed.path) as ck:
        mods = ck.modules()
        for name, d in MIXED_PLAN.items():
            fmt = d if isinstance(d, str) else d[0]
            assert mods[name].format == fmt, name
        assert mods['moe.gate'].format is None and mods['final_layer.linear'].format is None


def test_output_close_to_float_mixed(mixed):
    db = sqnr(mixed.ref, mixed.out)
    print(f'mixed: {db:.2f} dB')
    assert db >= SQNR_DB['mixed'] - SLACK, db


@pytest.mark.parametrize('fmt', list(SWEEP))
def test_output_close_to_float_per_format(fmt):
    xb = inputs()
    ref = run(moe_dit_model(0), xb)
    model = moe_dit_model(0)
    plan = uniform_plan(model, fmt, **SWEEP[fmt])
    assert plan, fmt
    quantize_model(model, plan)
    db = sqnr(ref, run(model, xb))
    print(f'{fmt}: {len(plan)} modules, {db:.2f} dB')
    assert db >= SQNR_DB[fmt] - SLACK, (fmt, db)


# ------------------------------------------------------------------------------------------------ comfy-kitchen
def kitchen_dequantize(t: dict, cfg: dict, shape, dtype):
    """comfy-kitchen's decode of one weight from its file tensors `t` (keys relative to the module), built the way
    ComfyUI's loader builds kitchen tensors (reference/comfyui_loader.md §2): scales popped per format, uint8 block
    scales reinterpreted with .view(), orig_dtype = the compute dtype, options from the top level or `params`."""
    from comfy_kitchen.tensor import (QuantizedTensor as KQT, TensorCoreFP8Layout, TensorCoreNVFP4Layout, TensorCoreMXFP8Layout,
                                      TensorWiseINT8Layout, TensorCoreConvRotW4A4Layout)
    import comfy_kitchen as ck
    p = cfg.get('params') if isinstance(cfg.get('params'), dict) else {}
    opt = lambda k, d: cfg.get(k, p.get(k, d))
    fmt, w = cfg['format'], t['weight']
    kw = dict(orig_dtype=dtype, orig_shape=tuple(shape))
    if fmt in ('float8_e4m3fn', 'float8_e5m2'):
        return KQT(w, 'TensorCoreFP8Layout', TensorCoreFP8Layout.Params(scale=t['weight_scale'], **kw)).dequantize()
    if fmt == 'nvfp4':
        return KQT(w.view(torch.uint8), 'TensorCoreNVFP4Layout', TensorCoreNVFP4Layout.Params(
            scale=t['weight_scale_2'], block_scale=t['weight_scale'].view(torch.float8_e4m3fn), **kw)).dequantize()
    if fmt == 'mxfp8':
        return KQT(w.view(torch.float8_e4m3fn), 'TensorCoreMXFP8Layout', TensorCoreMXFP8Layout.Params(
            scale=t['weight_scale'].view(torch.float8_e8m0fnu), **kw)).dequantize()
    if fmt == 'int8_tensorwise':
        return KQT(w, 'TensorWiseINT8Layout', TensorWiseINT8Layout.Params(
            scale=t['weight_scale'], convrot=bool(opt('convrot', False)), convrot_groupsize=int(opt('convrot_groupsize', 256)), **kw)).dequantize()
    if fmt == 'convrot_w4a4':
        return KQT(w, 'TensorCoreConvRotW4A4Layout', TensorCoreConvRotW4A4Layout.Params(
            scale=t['weight_scale'], convrot_groupsize=int(opt('convrot_groupsize', 256)), linear_dtype=opt('linear_dtype', 'int4'), **kw)).dequantize()
    if fmt in ('asym_w4a8_int8', 'w6a8_int8'):
        s_rel = t['weight_s_rel']
        if s_rel.dtype == torch.uint8: s_rel = s_rel.view(torch.float8_e4m3fn)
        return ck.dequantize_w4a8_int8_weight(w, s_rel, t['weight_s_channel'], t.get('weight_codebook'), None,
                                              int(opt('group_size', 16)), int(opt('convrot_groupsize', 256)), dtype)
    raise AssertionError(f'no kitchen decode for {fmt}')


def module_files(sd: dict, name: str) -> dict:
    p = name + '.'
    return {k[len(p):]: v for k, v in sd.items() if k.startswith(p) and '.' not in k[len(p):]}


def expert_files(t: dict, E: int, i: int) -> dict:
    "Expert i's tensors of a bank, sliced here independently of cquant: [E, ...] banks by index, [E*rows, ...] by rows."
    w = t['weight']
    if w.dim() == 2:
        R = w.shape[0]; r = R // E
        return {k: v[i * r:(i + 1) * r] if k != 'weight_codebook' and v.dim() >= 1 and v.shape[0] == R else v for k, v in t.items()}
    return {k: v[i] if v.dim() >= 1 and v.shape[0] == E else v for k, v in t.items()}


def test_kitchen_dequantizes_the_same(mixed):
    pytest.importorskip('comfy_kitchen', reason='comfy-kitchen (the oracle) is not installed')
    sd, model, n = mixed.loaded, mixed.fresh, 0
    for name, m in model.named_modules():
        if not isinstance(m, QuantModule) or m.format is None: continue
        t, cfg = module_files(sd, name), cq.decode_json(sd[name + '.comfy_quant'])
        if isinstance(m, QuantMoEExperts):
            for i in range(m.num_experts):
                ours = m.expert_weight(i).dequantize()
                assert_bits(kitchen_dequantize(expert_files(t, m.num_experts, i), cfg, ours.shape, ours.dtype), ours, f'{name} expert {i}')
                n += 1
        else:
            ours = m.weight.dequantize()
            assert_bits(kitchen_dequantize(t, cfg, ours.shape, ours.dtype), ours, name)
            n += 1
    assert n == len(MIXED_PLAN) - 2 + 2 * 4


def test_kitchen_embedding_lookup(mixed):
    pytest.importorskip('comfy_kitchen', reason='comfy-kitchen (the oracle) is not installed')
    from comfy_kitchen.tensor import TensorWiseINT8Layout
    e = mixed.fresh.y_embed
    t = module_files(mixed.loaded, 'y_embed')
    idx = torch.tensor([[5, 0, 63, 5], [17, 17, 2, 40]])
    kp = TensorWiseINT8Layout.Params(scale=t['weight_scale'], orig_dtype=e.weight.dtype, orig_shape=tuple(e.weight.shape),
                                     convrot=True, convrot_groupsize=16)
    assert_bits(TensorWiseINT8Layout.dequantize_embedding(t['weight'], kp, idx), e(idx), 'kitchen dequantize_embedding')


# ------------------------------------------------------------------------------------------------ ComfyUI's dequantized paths
# ComfyUI's formulas, re-implemented from Comfy-Org/ComfyUI comfy/ops.py @ 0271a469 with the same torch ops, operand
# layouts and casts (so bit-identity does not depend on the machine). cquant's QuantizedTensor.to(dtype), like kitchen's,
# changes only the dtype the weight decodes to; its dequantize is checked against kitchen's in test_kitchen_dequantizes_the_same.
def comfy_linear(x, qt, bias):
    "MixedPrecisionOps.Linear with _full_precision_mm: cast_bias_weight (weight .to(x.dtype) still quantized, bias .to(x.dtype)), weight.dequantize(), F.linear."
    w = qt.to(x.dtype) if qt.dtype != x.dtype else qt
    return torch.nn.functional.linear(x, w.dequantize(), None if bias is None else bias.to(x.dtype))


def comfy_expert_linear(x, qt, bias):
    "MoEExperts._expert_linear_impl, dequantized: cast_to_input(qw.dequantize(), x) (decoded in the bank dtype), cast_to_input(bias[i], x), F.linear."
    return torch.nn.functional.linear(x, qt.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))


def comfy_embedding(qt, idx, out_dtype=None):
    "MixedPrecisionOps.Embedding: int8 through kitchen's dequantize_embedding (in the table dtype) then .to(out_dtype); fp8: gather the raw table, .to(target) * scale.to(target)."
    if qt.format == 'int8_tensorwise':
        p = qt.params
        code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[qt.dtype]
        pytest.importorskip('comfy_kitchen', reason='comfy-kitchen (the oracle) is not installed')
        x = torch.ops.comfy_kitchen.dequantize_int8_embedding(qt.qdata, p.scale, idx, p.convrot_groupsize if p.convrot else 0, code).to(qt.dtype)
        return x if out_dtype is None else x.to(out_dtype)
    target = out_dtype or qt.dtype
    return F.embedding(idx, qt.qdata).to(target) * qt.params.scale.to(target)


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize('fmt', list(SWEEP))
@pytest.mark.parametrize('wdt,xdt', DTYPES, ids=lambda d: str(d).split('.')[-1])
def test_dequantized_linear_is_comfyui(fmt, wdt, xdt):
    "Disabled format, full_precision_mm and the file flag: bit-identical to ComfyUI's formula, 2-D and 3-D inputs, with and without bias."
    g = torch.Generator().manual_seed(7)
    for bias in (True, False):
        lin = nn.Linear(128, 64, bias=bias).to(wdt)
        q = QuantLinear.from_float(lin, fmt, **SWEEP[fmt])
        x3 = torch.randn(3, 5, 128, generator=g).to(xdt)
        for how in ('disabled', 'full_precision_mm', FPMM):
            q2 = QuantLinear(128, 64, bias=bias, dtype=wdt)
            sd = q.state_dict()
            if how == FPMM: sd['comfy_quant'] = cq.encode_json({**q.quant_config, FPMM: True})
            q2.load_state_dict(sd)
            if how == 'disabled': q2.disabled_formats = {fmt}
            if how == 'full_precision_mm': q2.full_precision_mm = True
            assert q2.runs_full_precision
            for x in (x3, x3[0]):
                assert_bits(q2(x), comfy_linear(x, q2.weight, q2.bias), f'{fmt} {how} bias={bias} x{tuple(x.shape)}')


BANK_FORMATS = [('float8_e4m3fn', {}), ('float8_e5m2', {}), ('nvfp4', {}), ('mxfp8', {}), ('int8_tensorwise', dict(per_row=True)),
                ('convrot_w4a4', dict(convrot_groupsize=64)), ('asym_w4a8_int8', dict(group_size=16, convrot_groupsize=64)),
                ('w6a8_int8', dict(group_size=32, convrot_groupsize=64))]


@pytest.mark.parametrize('fmt,opts', BANK_FORMATS, ids=[f for f, _ in BANK_FORMATS])
@pytest.mark.parametrize('wdt,xdt', DTYPES, ids=lambda d: str(d).split('.')[-1])
def test_dequantized_expert_linear_is_comfyui(fmt, opts, wdt, xdt):
    "Expert banks: full precision (2-D and 3-D inputs), and the format path on a 3-D input (ComfyUI's fast path needs 2-D)."
    E, K, N = 3, 128, 64
    g = torch.Generator().manual_seed(8)
    for bias in (True, False):
        torch.manual_seed(1)
        bank = QuantMoEExperts(E, K, N, bias=bias, dtype=wdt).quantize_(fmt, **opts)
        x3 = torch.randn(2, 6, K, generator=g).to(xdt)
        for e in range(E):
            b = None if bank.bias is None else bank.bias[e]
            assert_bits(bank.expert_linear(x3, e), comfy_expert_linear(x3, bank.expert_weight(e), b), f'{fmt} expert {e} 3-D input')
        bank.full_precision_mm = True
        for e in range(E):
            b = None if bank.bias is None else bank.bias[e]
            for x in (x3, x3[0]):
                assert_bits(bank.expert_linear(x, e), comfy_expert_linear(x, bank.expert_weight(e), b), f'{fmt} expert {e} x{tuple(x.shape)}')
    if (wdt, xdt) == (torch.bfloat16, torch.float32) and fmt == 'float8_e4m3fn':     # the cast order matters: bf16 decode, then fp32
        q = bank.expert_weight(0)
        assert not same_bits(q.dequantize().float(), q.dequantize(torch.float32))


# ------------------------------------------------------------------------------------------------ embeddings
@contextlib.contextmanager
def rows_decoded(layout):
    "Record the rows each `layout.dequantize` / `layout.dequantize_rows` call decodes (inherited methods too)."
    calls, names = [], [n for n in ('dequantize', 'dequantize_rows') if hasattr(layout, n)]
    saved = {n: (layout.__dict__.get(n), getattr(layout, n)) for n in names}      # own descriptor (or None: inherited), bound method
    def full(cls, qdata, params, dtype): calls.append(qdata.shape[0]); return saved['dequantize'][1](qdata, params, dtype)
    def rows(cls, qdata, params, idx, dtype): calls.append(idx.numel()); return saved['dequantize_rows'][1](qdata, params, idx, dtype)
    for n in names: setattr(layout, n, classmethod(full if n == 'dequantize' else rows))
    try: yield calls
    finally:
        for n, (own, _) in saved.items():
            if own is None: delattr(layout, n)
            else: setattr(layout, n, own)


EMB_CASES = [('float8_e4m3fn', {}), ('float8_e5m2', {}), ('int8_tensorwise', {}), ('int8_tensorwise', dict(per_row=True)),
             ('int8_tensorwise', dict(convrot=True, convrot_groupsize=64)), ('int8_tensorwise', dict(convrot=True, convrot_groupsize=16))]


@pytest.mark.parametrize('fmt,opts', EMB_CASES, ids=[f'{f}-{o}' for f, o in EMB_CASES])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_embedding_lookup_decodes_only_rows(fmt, opts, dtype):
    g = torch.Generator().manual_seed(3)
    emb = nn.Embedding(20000, 64).to(dtype)
    with torch.no_grad(): emb.weight.copy_(torch.randn(20000, 64, generator=g) * torch.rand(20000, 1, generator=g) * 4)
    e = QuantEmbedding.from_float(emb, fmt, **opts)
    idx = torch.randint(0, 20000, (3, 7), generator=g)
    idx[0, 0] = idx[2, 6] = 19999
    with rows_decoded(e.weight.layout) as calls: out = e(idx)
    assert calls and max(calls) <= idx.numel(), calls                        # never the 20000-row table
    assert out.shape == (3, 7, 64) and out.dtype == dtype
    assert_bits(out, e.weight.dequantize()[idx], 'lookup vs dequantize-then-index')
    for out_dtype in (torch.float32, torch.bfloat16):
        assert_bits(e(idx, out_dtype=out_dtype), comfy_embedding(e.weight, idx, out_dtype), f'{out_dtype} lookup, as ComfyUI')
    e2 = QuantEmbedding(20000, 64, dtype=dtype)
    assert str(e2.load_state_dict(e.state_dict())) == '<All keys matched successfully>'
    assert_bits(e2(idx), out, 'reloaded')


def test_embedding_rules():
    q8 = torch.randint(-127, 128, (10, 16), dtype=torch.int8)
    e = QuantEmbedding(10, 16)
    e.load_state_dict({'weight': q8, 'comfy_quant': cq.encode_json({'format': 'int8_tensorwise', 'params': {'convrot': True}})})
    assert (e.weight.params.convrot, float(e.weight.params.scale)) == (False, 1.0)    # top-level rotation only; scale 1.0
    assert_bits(e(torch.arange(10)), q8.float())
    with pytest.raises(cq.QuantFormatError, match="for QuantEmbedding, found 'mxfp8'"):
        e.load_state_dict({'weight': q8, 'comfy_quant': cq.encode_json({'format': 'mxfp8'})})
    with pytest.raises(IndexError): e(torch.tensor([10]))


# ------------------------------------------------------------------------------------------------ expert banks
BANK_CASES = [('float8_e4m3fn', {}), ('float8_e4m3fn', dict(shared_scale=True)), ('float8_e5m2', {}), ('nvfp4', {}), ('mxfp8', {}),
              ('int8_tensorwise', {}), ('int8_tensorwise', dict(shared_scale=True)), ('int8_tensorwise', dict(per_row=True)),
              ('int8_tensorwise', dict(convrot=True, convrot_groupsize=64)), ('convrot_w4a4', dict(convrot_groupsize=64)),
              ('asym_w4a8_int8', dict(group_size=16, convrot_groupsize=64)), ('w6a8_int8', dict(group_size=32, convrot_groupsize=64))]
FLAT = {'asym_w4a8_int8', 'w6a8_int8'}


@pytest.mark.parametrize('fmt,opts', BANK_CASES, ids=[f'{f}-{o}' for f, o in BANK_CASES])
def test_expert_bank(fmt, opts):
    E, K, N = 4, 128, 64
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    bank = QuantMoEExperts(E, K, N)
    W, B = bank.weight.detach().clone(), bank.bias.detach().clone()
    bank.quantize_(fmt, **opts)
    sd = bank.state_dict()
    assert cq.decode_json(sd['comfy_quant'])['num_experts'] == E
    flat = fmt in FLAT or opts.get('per_row') or opts.get('convrot')
    assert sd['weight'].shape[0] == (E * N if flat else E)
    b2 = QuantMoEExperts(E, K, N)
    assert str(b2.load_state_dict(sd)) == '<All keys matched successfully>'
    x, ids = torch.randn(40, K, generator=g), torch.randint(0, E, (40,), generator=g)
    y = b2(x, ids)
    assert_bits(y, bank(x, ids), 'reloaded bank')
    for e in range(E):
        sel, q = ids == e, b2.expert_weight(e)
        assert isinstance(q, QuantizedTensor) and q.shape == (N, K)
        assert_bits(y[sel], q.layout.linear(x[sel], q.qdata, q.params, B[e]), f'expert {e}: its own linear')
        ref = F.linear(x[sel], W[e], B[e])                                    # the float expert
        assert sqnr(ref, y[sel]) > 12, (e, sqnr(ref, y[sel]))
    b2.full_precision_mm = True
    for e in range(E):
        sel = ids == e
        with rows_decoded(b2.expert_weight(e).layout) as calls: ye = b2.expert_linear(x[sel], e)
        assert len(calls) == 1 and calls[0] == b2.expert_weight(e).qdata.shape[0], calls    # this expert only
        assert_bits(ye, F.linear(x[sel], b2.expert_weight(e).dequantize(), B[e]), f'expert {e} full precision')
    assert_bits(b2(x.reshape(E, 10, K)), torch.stack([b2.expert_linear(x.reshape(E, 10, K)[e], e) for e in range(E)]), 'stacked input')


def test_expert_bank_forms_and_errors():
    E, K, N = 4, 128, 64
    flat = QuantMoEExperts(E, K, N).quantize_('int8_tensorwise', per_row=True).state_dict()
    three_d = {**flat, 'weight': flat['weight'].reshape(E, N, K), 'weight_scale': flat['weight_scale'].reshape(E, N, 1)}
    b = QuantMoEExperts(E, K, N); b.load_state_dict(three_d)                   # ComfyUI flattens 3-D per-row banks
    for k, v in b.state_dict().items(): assert_bits(v, flat[k], k)
    w4 = QuantMoEExperts(E, K, N).quantize_('asym_w4a8_int8', group_size=16, convrot_groupsize=64).state_dict()
    stacked = {k: v.reshape(E, -1, *v.shape[1:]) if k in ('weight', 'weight_s_rel', 'weight_s_channel') else v for k, v in w4.items()}
    b = QuantMoEExperts(E, K, N); b.load_state_dict(stacked)
    for k, v in b.state_dict().items(): assert_bits(v, w4[k], k)
    with pytest.raises(cq.QuantFormatError, match="'input_scale': expected no input_scale"):
        QuantMoEExperts(E, K, N).load_state_dict({**flat, 'input_scale': torch.tensor(1.0)})
    with pytest.raises(cq.QuantFormatError, match="'pre_quant_scale': expected no input_scale"):
        QuantMoEExperts(E, K, N).load_state_dict({**flat, 'pre_quant_scale': torch.ones(K)})
    with pytest.raises(cq.QuantFormatError, match='expected 4 .* found 3'):
        QuantMoEExperts(E, K, N).load_state_dict({**flat, 'comfy_quant': cq.encode_json({'format': 'int8_tensorwise', 'num_experts': 3})})
    f8 = QuantMoEExperts(E, K, N).quantize_('float8_e4m3fn').state_dict()
    with pytest.raises(cq.QuantFormatError, match=r'\(expert 0 of 4\)'):
        QuantMoEExperts(E, K, N).load_state_dict({**f8, 'weight_scale': torch.ones(E, 2)})
    with pytest.raises(cq.QuantFormatError, match='leading expert dim 4'):
        QuantMoEExperts(E, K, N).load_state_dict({**f8, 'weight': f8['weight'][:3], 'weight_scale': f8['weight_scale'][:3]})


def test_moe_block_experts_match_float_reference(mixed):
    "In the mixed model, every routed token's expert output equals the expert's own linear, near its float expert."
    moe_q, moe_f = mixed.fresh.moe, moe_dit_model(0).moe
    g = torch.Generator().manual_seed(9)
    h = torch.randn(64, MOE_DIT['dim'], generator=g)
    ids = torch.arange(64) % MOE_DIT['experts']
    for bank_q, bank_f in ((moe_q.up, moe_f.up), (moe_q.down, moe_f.down)):
        x = h if bank_q.in_features == h.shape[1] else torch.randn(64, bank_q.in_features, generator=g)
        y = bank_q(x, ids)
        for e in range(bank_q.num_experts):
            sel, q = ids == e, bank_q.expert_weight(e)
            assert_bits(y[sel], q.layout.linear(x[sel], q.qdata, q.params, None), f'expert {e}')
            assert sqnr(F.linear(x[sel], bank_f.expert_weight(e)), y[sel]) > 12


# ------------------------------------------------------------------------------------------------ LoRA
def test_lora_patch_unpatch(mixed):
    model = mixed.fresh
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(11)
    patched = []
    for name, m in model.named_modules():
        if not isinstance(m, (QuantLinear, QuantEmbedding)) or m.format is None: continue
        N, K = m.weight.shape
        up, down = torch.randn(N, 8, generator=g) * 0.02, torch.randn(8, K, generator=g) * 0.02
        target = m.weight.dequantize(torch.float32) + lora_delta(up, down, alpha=4.0)
        cfg = m.quant_config
        apply_lora(m, up, down, alpha=4.0)
        assert m.key == name + '.weight'
        assert (m.format, m.quant_config) == (cfg['format'], cfg), name
        assert not same_bits(m.weight.qdata, before[name + '.weight']), name
        err = sqnr(target, m.weight.dequantize(torch.float32))
        assert err > 10, (name, err)
        # the same patch on a fresh copy of the same weights gives the same bits (seed from the key)
        twin = type(m).from_float(nn.Linear(K, N) if isinstance(m, QuantLinear) else nn.Embedding(N, K))
        twin.load_state_dict(module_files(before, name), strict=False)
        apply_lora(twin, up, down, alpha=4.0, key=name + '.weight')
        assert_bits(twin.weight.qdata, m.weight.qdata, f'{name}: deterministic requantization')
        assert string_to_seed(name + '.weight') != 0
        patched.append(name)
    assert len(patched) == len(MIXED_PLAN) - 2
    sd = model.state_dict()
    cq.load_file(cq.save_file(sd, mixed.path + '.lora.safetensors'))         # a patched model is still a valid checkpoint
    for name in patched: unpatch(model.get_submodule(name))
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for k, v in before.items(): assert_bits(after[k], v, f'unpatched {k}')
    assert_bits(run(model, mixed.xb), mixed.out, 'unpatched output')


def test_lora_seed_and_float():
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    up, down = torch.randn(64, 2) * 0.1, torch.randn(2, 128) * 0.1
    a = apply_lora(QuantLinear.from_float(lin, 'nvfp4'), up, down, seed=1).weight.qdata
    b = apply_lora(QuantLinear.from_float(lin, 'nvfp4'), up, down, seed=2).weight.qdata
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match='pass key='): apply_lora(QuantLinear.from_float(lin, 'nvfp4'), up, down)
    f = QuantLinear.from_float(nn.Linear(128, 64))
    w0 = f.weight
    apply_lora(f, up, down, strength=0.5)
    assert torch.allclose(f.weight, w0 + 0.5 * up @ down)
    assert unpatch(f).weight is w0


# ------------------------------------------------------------------------------------------------ compute paths
@pytest.mark.parametrize('fmt', list(SWEEP))
def test_disabled_format_fallback(fmt):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    x = torch.randn(4, 16, 128)
    q = QuantLinear.from_float(lin, fmt, **SWEEP[fmt])
    emulated = q(x)
    q.disabled_formats = {fmt}
    assert q.runs_full_precision and q.quant_config == q.weight.config                 # nothing added to comfy_quant
    fallback = q(x)
    assert_bits(fallback, F.linear(x, q.weight.dequantize(), lin.bias.detach()), 'fallback = F.linear on the dequantized weight')
    db = sqnr(fallback, emulated)
    print(f'{fmt}: fallback vs emulated {db:.2f} dB')
    assert db >= FALLBACK_DB[fmt] - SLACK, (fmt, db)
    assert FPMM not in q.quant_config                                          # a device's choice is never written


def test_set_quant_compute(mixed):
    model = mixed.fresh
    try:
        set_quant_compute(model, disabled_formats='auto')
        assert model.blocks[0].attn.qkv.disabled_formats == comfy_disabled_formats('cpu')
        set_quant_compute(model, disabled_formats=set(ALL8))
        dis = run(model, mixed.xb)
        set_quant_compute(model, disabled_formats=set(), full_precision_mm=True)
        assert_bits(run(model, mixed.xb), dis, 'full_precision_mm == every format disabled')
        assert sqnr(mixed.out, dis) >= DEQUANT_VS_KERNEL_DB - SLACK, sqnr(mixed.out, dis)
    finally: set_quant_compute(model, disabled_formats=set(), full_precision_mm=False)
    assert_bits(run(model, mixed.xb), mixed.out, 'back to the emulated kernels')


def test_dtype_and_device_moves(mixed):
    model = moe_dit_model(0)
    load_quantized_model(model, mixed.loaded)
    model.to(torch.bfloat16)
    qkv = model.blocks[0].attn.qkv
    assert isinstance(qkv.weight, QuantizedTensor) and qkv.weight.dtype == torch.bfloat16 and qkv.weight.qdata.dtype == torch.int8
    assert model.moe.up.dtype == torch.bfloat16
    out = run(model, tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in mixed.xb))
    assert out.dtype == torch.bfloat16 and sqnr(mixed.out, out.float()) >= BF16_VS_FP32_DB - SLACK, sqnr(mixed.out, out.float())
    for k, v in model.state_dict().items():
        if k.endswith(('.weight', 'weight_scale', 'weight_s_rel')) and not v.is_floating_point(): assert_bits(v, mixed.loaded[k], k)


# ------------------------------------------------------------------------------------------------ loading rules
def test_missing_and_unexpected_keys(mixed):
    sd = dict(mixed.loaded)
    del sd['blocks.0.attn.qkv.bias']
    sd['blocks.0.attn.proj.input_scale'] = torch.tensor(1.0)      # integer format: not loaded, unexpected
    sd['nowhere.comfy_quant'] = cq.encode_json({'format': 'nvfp4'})
    with pytest.warns(LoadKeysWarning) as warned: res = load_quantized_model(moe_dit_model(0), sd, strict=False).load_result
    assert res.missing_keys == ['blocks.0.attn.qkv.bias']
    assert sorted(res.unexpected_keys) == ['blocks.0.attn.proj.input_scale', 'nowhere.comfy_quant']
    stray = {**sd, 'final_layer.linear.weight_scale': torch.tensor(1.0)}     # a scale on a float module: never loaded
    for strict in (True, False):
        with pytest.raises(cq.QuantFormatError, match="load_quantized_model: 'final_layer.linear.weight_scale': expected "
                           "no scale tensors on module 'final_layer.linear' without a comfy_quant entry"):
            load_quantized_model(moe_dit_model(0), stray, strict=strict)
    with pytest.raises(LoadKeysError) as err: load_quantized_model(moe_dit_model(0), sd)
    assert isinstance(err.value, RuntimeError) and err.value.missing_keys == res.missing_keys
    assert str(err.value).startswith(str(warned[0].message))
    float_sd = moe_dit_model(3).state_dict()
    model = moe_dit_model(0); load_quantized_model(model, mixed.loaded)
    res = model.load_state_dict(float_sd)                          # a float state dict makes the modules float again
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert all(m.format is None for m in model.modules() if isinstance(m, QuantModule))
    assert_bits(run(model, mixed.xb), run(moe_dit_model(3), mixed.xb), 'float reload')


@pytest.mark.filterwarnings('ignore::cquant.policy.PolicyWarning')   # 'auto' finds no known architecture in the test model
def test_quantize_model_from_policy_plan(tmp_path):
    model = moe_dit_model(0)
    plan = Policy(mode='int8_convrot', preset='auto', keep_float=('final_layer',)).plan(model)
    quantize_model(model, plan)
    fmts = {n: m.format for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for n, d in plan.items():
        if n in fmts: assert fmts[n] == d.format, n
        if d.format is not None: assert cq.decode_json(model.state_dict()[n + '.comfy_quant']) == d.config, n
    assert any(f is not None for f in fmts.values())
    p = str(tmp_path / 'p.safetensors')
    cq.save_file(model.state_dict(), p)
    fresh = moe_dit_model(2)
    assert str(load_quantized_model(fresh, cq.load_file(p)).load_result) == '<All keys matched successfully>'
    xb = inputs()
    assert_bits(run(fresh, xb), run(model, xb), 'policy-planned model round trip')


@pytest.mark.parametrize('fmt,opts', [('float8_e4m3fn', {}), ('nvfp4', {}), ('mxfp8', {}), ('int8_tensorwise', {}), ('convrot_w4a4', dict(convrot_groupsize=64))])
def test_stacked_bank_file_round_trip(tmp_path, fmt, opts):
    "[E, ...] banks with per-expert scales: cq.save_file / cq.load_file validate them expert by expert."
    E, K, N = 4, 128, 64
    bank = QuantMoEExperts(E, K, N).quantize_(fmt, **opts)
    p = str(tmp_path / 'bank.safetensors')
    cq.save_file(bank.state_dict(prefix='moe.up.'), p)
    loaded = {k[len('moe.up.'):]: v for k, v in cq.load_file(p).items()}
    for k, v in bank.state_dict().items(): assert_bits(loaded[k], v, k)
    b2 = QuantMoEExperts(E, K, N)
    assert str(b2.load_state_dict(loaded)) == '<All keys matched successfully>'
    x, ids = torch.randn(24, K), torch.arange(24) % E
    assert_bits(b2(x, ids), bank(x, ids), 'bank from file')
