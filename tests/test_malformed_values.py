"""Malformed scale values (NaN, inf, negative, zero, FP8/E8M0 NaN codes) and activation tensors: every entry point
refuses them at load, naming the module and key, what was expected and what was found; a quantize never returns
an inf scale. Each malformed input is built here from a valid quantized module."""
import pytest
import torch
import safetensors.torch
from torch import nn

import cquant as cq
from cquant.cli import main as cli_main
from cquant.numerics import hadamard
from cquant.tensor import QuantFormatError

NAME, P = 'blk.lin', 'blk.lin.'
NAN, INF = float('nan'), float('inf')
POS = 'expected finite and > 0'
NONNEG = 'expected finite and >= 0'


def module(fmt, shape=(32, 64), **opts):
    "A valid quantized module `blk.lin` of `fmt`: its file entries, with comfy_quant."
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    qt = cq.quantize(w, fmt, name=P + 'weight', **opts)
    return {**qt.state_dict(P), P + 'comfy_quant': cq.tensor.encode_json(qt.config)}, tuple(shape)


def with_value(key, v):
    return lambda sd: {**sd, P + key: torch.full_like(sd[P + key], v)}


def at(key, idx, v):
    def f(sd):
        t = sd[P + key].clone(); t[idx] = v
        return {**sd, P + key: t}
    return f


def code_bytes(key, idx, byte):
    "Set storage byte(s) of an FP8 / E8M0 tensor (its NaN codes are 0x7F / 0xFF)."
    def f(sd):
        t = sd[P + key]; b = t.view(torch.uint8).clone(); b[idx] = byte
        return {**sd, P + key: b.view(t.dtype)}
    return f


def add(key, t): return lambda sd: {**sd, P + key: t}


FP8, NV, MX, I8, W4 = 'float8_e4m3fn', 'nvfp4', 'mxfp8', 'int8_tensorwise', 'convrot_w4a4'
WEIGHT_CASES = {   # id: (format, options, mutation, substring of the error)
    'fp8_nan': (FP8, {}, with_value('weight_scale', NAN), f"'{P}weight_scale': {POS}: the one scale multiplies every stored value, found nan"),
    'fp8_inf': (FP8, {}, with_value('weight_scale', INF), f"'{P}weight_scale': {POS}"),
    'fp8_negative': (FP8, {}, with_value('weight_scale', -0.5), "found -0.5"),
    'fp8_zero': (FP8, {}, with_value('weight_scale', 0.0), f"'{P}weight_scale': {POS}: the one scale multiplies every stored value, found 0.0"),
    'nvfp4_scale2_negative': (NV, {}, with_value('weight_scale_2', -0.01), f"'{P}weight_scale_2': {NONNEG}: the global scale"),
    'nvfp4_scale2_nan': (NV, {}, with_value('weight_scale_2', NAN), f"'{P}weight_scale_2': {NONNEG}"),
    'nvfp4_scale2_inf': (NV, {}, with_value('weight_scale_2', INF), "found inf"),
    'nvfp4_blocks_all_nan': (NV, {}, code_bytes('weight_scale', slice(None), 0x7F), f"'{P}weight_scale': {NONNEG}: a block scale multiplies its 16 values"),
    'mxfp8_e8m0_nan': (MX, {}, code_bytes('weight_scale', (3, 1), 0xFF), "found 1 NaN of"),
    'int8_row_nan': (I8, {'per_row': True}, at('weight_scale', 3, NAN), f"'{P}weight_scale': {POS}: the tensor or row scale multiplies the int8 values, found 1 NaN of 32, first at row 3 (nan)"),
    'int8_negative': (I8, {'per_row': True}, at('weight_scale', slice(4, 6), -1.0), "found 2 negative of 32, first at row 4 (-1.0)"),
    'int8_tensorwise_zero': (I8, {}, with_value('weight_scale', 0.0), f"'{P}weight_scale': {POS}"),
    'convrot_w4a4_nan': (W4, {'convrot_groupsize': 16}, at('weight_scale', 0, NAN), f"'{P}weight_scale': {NONNEG}: a row scale multiplies its int4 values (an all-zero fp16 row has 0: kitchen's 1e-10 floor underflows), found 1 NaN of 32, first at row 0"),
    'w4a8_s_rel_nan': ('asym_w4a8_int8', {'convrot_groupsize': 64}, code_bytes('weight_s_rel', (2, 1), 0x7F), f"'{P}weight_s_rel': {NONNEG}: a group scale multiplies its codes"),
    'w4a8_s_channel_negative': ('asym_w4a8_int8', {'convrot_groupsize': 64}, at('weight_s_channel', 7, -1.0), "found 1 negative of 32, first at row 7 (-1.0)"),
    'w6a8_s_channel_zero': ('w6a8_int8', {'convrot_groupsize': 64}, at('weight_s_channel', 0, 0.0), f"'{P}weight_s_channel': {POS}: the row scale multiplies every group scale of its row, found 1 zero of 32"),
}
ACTIVATION_CASES = {
    'input_scale_nan': (NV, {}, add('input_scale', torch.tensor(NAN)), f"'{P}input_scale': {POS}: the activation is divided by it"),
    'input_scale_negative': (NV, {}, add('input_scale', torch.tensor(-0.5)), "found -0.5"),
    'input_scale_fp8_dtype': (FP8, {}, add('input_scale', torch.tensor(0.5).to(torch.float8_e4m3fn)), f"'{P}input_scale': expected a float"),
    'pre_quant_scale_nan': (NV, {}, add('pre_quant_scale', torch.ones(64).index_fill_(0, torch.tensor([5]), NAN)), "found 1 NaN of 64, first at row 5"),
    'pre_quant_scale_all_zero': (NV, {}, add('pre_quant_scale', torch.zeros(64)), "found 64 zero of 64"),
}


def save(tmp_path, sd):
    path = tmp_path / 'bad.safetensors'
    safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def via_load_quantized(tmp_path, sd, shape): cq.load_quantized(sd, NAME, shape)
def via_load_file(tmp_path, sd, shape): cq.load_file(save(tmp_path, sd))


def via_open_checkpoint(tmp_path, sd, shape):
    ck = cq.open_checkpoint(save(tmp_path, sd))
    ck.modules()
    ck.quantized(NAME, shape)


def via_inspect(tmp_path, sd, shape, capsys=None):
    rc = cli_main(['inspect', str(save(tmp_path, sd))])
    if rc: raise ValueError(capsys.readouterr().err)


def via_model(tmp_path, sd, shape):
    model = nn.ModuleDict({'blk': nn.ModuleDict({'lin': nn.Linear(shape[1], shape[0], bias=False)})})
    cq.load_quantized_model(model, sd)


WEIGHT_ENTRIES = {'load_quantized': via_load_quantized, 'load_file': via_load_file,
                  'open_checkpoint': via_open_checkpoint, 'inspect': via_inspect, 'load_quantized_model': via_model}
ACTIVATION_ENTRIES = {k: v for k, v in WEIGHT_ENTRIES.items() if k != 'load_quantized'}   # it loads no activations


def check(entry, tmp_path, capsys, fmt, opts, mutate, msg):
    sd, shape = module(fmt, **opts)
    bad = mutate(sd)
    run = (lambda *a: entry(*a, capsys=capsys)) if entry is via_inspect else entry
    run(tmp_path, sd, shape)                                    # the valid module loads through the entry point
    if entry is via_inspect: capsys.readouterr()
    with pytest.raises(Exception) as e: run(tmp_path, bad, shape)
    assert msg in str(e.value), str(e.value)
    assert isinstance(e.value, (ValueError, QuantFormatError)), type(e.value)


@pytest.mark.parametrize('entry', list(WEIGHT_ENTRIES))
@pytest.mark.parametrize('case', list(WEIGHT_CASES))
@pytest.mark.writes_invalid
def test_bad_weight_scale(case, entry, tmp_path, capsys):
    check(WEIGHT_ENTRIES[entry], tmp_path, capsys, *WEIGHT_CASES[case])


@pytest.mark.parametrize('entry', list(ACTIVATION_ENTRIES))
@pytest.mark.parametrize('case', list(ACTIVATION_CASES))
@pytest.mark.writes_invalid
def test_bad_activation(case, entry, tmp_path, capsys):
    check(ACTIVATION_ENTRIES[entry], tmp_path, capsys, *ACTIVATION_CASES[case])


@pytest.mark.parametrize('entry', ['load_file', 'open_checkpoint', 'inspect'])
@pytest.mark.writes_invalid
def test_legacy_negative_scale_weight(entry, tmp_path, capsys):
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(torch.float8_e4m3fn)
    good = {'m.scaled_fp8': torch.empty(0, dtype=torch.float8_e4m3fn), 'm.blk.lin.weight': w,
            'm.blk.lin.scale_weight': torch.tensor(0.5)}
    bad = {**good, 'm.blk.lin.scale_weight': torch.tensor(-0.5)}
    fn = {'load_file': lambda p: cq.load_file(p), 'open_checkpoint': lambda p: cq.open_checkpoint(p).modules(),
          'inspect': lambda p: cli_main(['inspect', str(p)])}[entry]
    assert fn(save(tmp_path, good)) is not None
    if entry == 'inspect':
        capsys.readouterr()
        assert fn(save(tmp_path, bad)) != 0
        assert f"'m.blk.lin.weight_scale': {POS}" in capsys.readouterr().err
    else:
        with pytest.raises(ValueError, match=r"'m\.blk\.lin\.weight_scale': expected finite and > 0.*found -0\.5"):
            fn(save(tmp_path, bad))


def _overflowing(value, dtype, K=64, G=16):
    "Rows along one Hadamard row, |w| = value: their rotation in `dtype` overflows (kitchen writes an inf scale)."
    return (value * hadamard(G, torch.float32)[0].sign()).repeat(4, K // G).to(dtype)


CONVROT = [(W4, {'convrot_groupsize': 16}), (I8, {'convrot': True, 'convrot_groupsize': 16})]


@pytest.mark.parametrize('fmt,opts', CONVROT)
def test_quantize_never_writes_inf(fmt, opts):
    "fp16 near 65504: the overflowing rows rotate in fp32 (finite scale, exact decode); the other rows keep fp16 bytes."
    w = _overflowing(65504, torch.float16)
    ok = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).half()
    qt = cq.quantize(torch.cat([ok, w]), fmt, name=P + 'weight', **opts)
    s = qt.state_dict()['weight_scale'].reshape(-1)
    assert bool(torch.isfinite(s).all()) and float(s.min()) > 0
    err = (qt.dequantize(torch.float32)[8:] - w.float()).abs().max()
    assert float(err) < 65504 / 100, float(err)
    assert torch.equal(qt.state_dict()['weight'][:8], cq.quantize(ok, fmt, **opts).state_dict()['weight'])
    assert torch.equal(s[:8], cq.quantize(ok, fmt, **opts).state_dict()['weight_scale'].reshape(-1))


@pytest.mark.parametrize('fmt,opts', CONVROT)
def test_quantize_refuses_inf_scale(fmt, opts):
    "fp32 near its max overflows in fp32 too: refused, naming the key and the weight, never written."
    with pytest.raises(QuantFormatError, match=r"'blk\.lin\.weight_scale': expected finite and >=? 0.*found 4 inf of 4.*"
                                               r"after quantizing blk\.lin\.weight \(torch\.float32"):
        cq.quantize(_overflowing(3e38, torch.float32), fmt, name=P + 'weight', **opts)


@pytest.mark.parametrize('fmt,opts', [(I8, {'per_row': True}), (FP8, {}), (NV, {})])
@pytest.mark.parametrize('entry', ['load_file', 'QuantMoEExperts'])
@pytest.mark.writes_invalid
def test_bad_bank_expert_scale(fmt, opts, entry, tmp_path):
    "An MoE bank whose last expert's scales hold NaN: refused when each expert is split and loaded."
    from cquant.modules import QuantMoEExperts
    torch.manual_seed(0)
    sd = QuantMoEExperts(3, 64, 32).quantize_(fmt, **opts).state_dict(prefix='moe.up.')
    key = 'moe.up.weight_scale_2' if fmt == NV else 'moe.up.weight_scale'
    s = sd[key].clone(); s.view(-1)[-1] = NAN
    bad = {**sd, key: s}
    load = {'load_file': lambda d: cq.load_file(save(tmp_path, d)),
            'QuantMoEExperts': lambda d: QuantMoEExperts(3, 64, 32).load_state_dict({k[7:]: v for k, v in d.items()})}[entry]
    load(sd)
    where = key if entry == 'load_file' else key[len('moe.up.'):]      # a root module has no prefix
    with pytest.raises(ValueError, match=rf"'{where}': expected finite and >=? 0.*found .*nan"):
        load(bad)
