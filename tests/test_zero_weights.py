"""All-zero weights as other writers store them (issue 39): a 0 scale over all-zero codes is what the file means
exactly, so every entry point loads it (exact zeros, a `QuantFormatWarning` naming module and key); comfy-kitchen
0.2.40's FP8 and NVFP4 encodings of an all-zero weight hold NaN (ComfyUI would compute NaN), so every entry point
refuses them and says what the file is."""
import warnings
import pytest
import torch
import safetensors.torch

import cquant as cq
from cquant.cli import main as cli_main
from cquant.tensor import QuantFormatError, QuantFormatWarning

ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen 0.2.40 writes the all-zero files")
from comfy_kitchen.tensor import QuantizedTensor as KQT  # noqa: E402

NAME, P, SHAPE = 'blk.proj', 'blk.proj.', (32, 64)
KITCHEN = {'float8_e4m3fn': ('TensorCoreFP8Layout', {'dtype': torch.float8_e4m3fn}),
           'nvfp4': ('TensorCoreNVFP4Layout', {})}


def write(tmp_path, sd: dict, config: dict):
    "A file as another writer leaves it (no cquant checks): the module plus one float layer."
    path = tmp_path / 'm.safetensors'
    sd = {**sd, P + 'comfy_quant': cq.encode_json(config), 'blk.other.weight': torch.randn(8, 8)}
    safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def kitchen_zero(fmt: str) -> dict:
    "comfy-kitchen's own encoding of an all-zero bf16 weight."
    layout, kw = KITCHEN[fmt]
    return dict(KQT.from_float(torch.zeros(SHAPE, dtype=torch.bfloat16), layout, **kw).state_dict(P + 'weight'))


def zero_codes(fmt: str, **opts) -> dict:
    "A valid module with every code and every (per-tensor or per-row) scale set to 0."
    sd = cq.quantize(torch.randn(SHAPE), fmt, **opts).state_dict(P)
    codes = sd[P + 'weight']
    return {**sd, P + 'weight': torch.zeros(codes.shape).to(codes.dtype), P + 'weight_scale': torch.zeros_like(sd[P + 'weight_scale'])}


ZERO_CASES = {'fp8': ('float8_e4m3fn', {}), 'int8': ('int8_tensorwise', {}), 'int8_per_row': ('int8_tensorwise', {'per_row': True}),
              'int8_convrot': ('int8_tensorwise', {'per_row': True, 'convrot': True, 'convrot_groupsize': 64})}


def entry_points(path):
    "Each way a user meets the file: (name, call returning the module's dequantized weight or None)."
    return {'load_file': lambda: cq.load_quantized(cq.load_file(str(path)), NAME, SHAPE, torch.float32).dequantize(),
            'open_checkpoint': lambda: cq.open_checkpoint(str(path)).quantized(NAME, SHAPE, torch.float32).dequantize(),
            'load_quantized_model': lambda: cq.load_quantized_model(
                torch.nn.ModuleDict({'blk': torch.nn.ModuleDict({'proj': torch.nn.Linear(64, 32, bias=False),
                                                                 'other': torch.nn.Linear(8, 8, bias=False)})}),
                cq.load_file(str(path)))['blk']['proj'].weight.dequantize().float()}


@pytest.mark.parametrize('case', ZERO_CASES)
def test_zero_scale_over_zero_codes_loads_as_zeros(tmp_path, case):
    fmt, opts = ZERO_CASES[case]
    sd = zero_codes(fmt, **opts)
    config = cq.quantize(torch.randn(SHAPE), fmt, **opts).config
    path = write(tmp_path, sd, config)
    for name, call in entry_points(path).items():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter('always')
            w = call()
        assert bool((w == 0).all()), f"{case} via {name}: {w.unique()}"
        msgs = [str(g.message) for g in got if issubclass(g.category, QuantFormatWarning)]
        assert msgs and f"'{P}weight_scale'" in msgs[0] and 'over all-zero codes' in msgs[0], f"{case} via {name}: {msgs}"
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        assert cli_main(['inspect', str(path)]) == 0
        rep = cq.validate(str(path))
    assert rep.ok and any('over all-zero codes' in m for m in rep.warnings), rep.warnings


def test_zero_scale_over_nonzero_codes_refused():
    sd = cq.quantize(torch.randn(SHAPE), 'float8_e4m3fn').state_dict(P)
    sd[P + 'weight_scale'] = torch.zeros_like(sd[P + 'weight_scale'])
    with pytest.raises(QuantFormatError, match=r"found 0\.0 over codes that are not all 0 \(a 0 scale is legal only there\)$"):
        cq.load_quantized(sd, NAME, SHAPE, config={'format': 'float8_e4m3fn'})


@pytest.mark.writes_invalid
@pytest.mark.parametrize('fmt', KITCHEN)
def test_kitchen_all_zero_weight_refused_with_what_it_is(tmp_path, fmt, capsys):
    sd = kitchen_zero(fmt)
    assert any(bool(v.float().isnan().any()) for v in sd.values()), "kitchen's NaN all-zero encoding changed: update this test"
    path = write(tmp_path, sd, {'format': fmt})
    said = "says the weight was all 0, stored with NaN under it (comfy-kitchen 0.2.40 writes an all-zero weight so"
    for name, call in entry_points(path).items():
        with pytest.raises(QuantFormatError, match=r"'blk\.proj\.weight_scale': .*" + r"says the weight was all 0"):
            call()
    assert cli_main(['inspect', str(path)]) == 1
    assert said in capsys.readouterr().err
    rep = cq.validate(str(path))
    assert not rep.ok and said in rep.errors[0], rep.errors


@pytest.mark.writes_invalid
@pytest.mark.parametrize('fmt', KITCHEN)
def test_convert_repairs_kitchen_all_zero_weight(tmp_path, fmt, capsys):
    path = write(tmp_path, kitchen_zero(fmt), {'format': fmt})
    out = tmp_path / 'fixed.safetensors'
    with pytest.warns(cq.CheckpointWarning, match=r"module 'blk\.proj' \(" + fmt + r"\) is an all-zero weight stored with NaN"):
        r = cq.convert_checkpoint(str(path), str(out))
    assert r['repaired'] == [NAME] and r['formats'] == {fmt: 1}
    sd, src = cq.load_file(str(out)), safetensors.torch.load_file(str(path))
    assert bool((cq.load_quantized(sd, NAME, SHAPE, torch.float32).dequantize() == 0).all())
    assert set(sd) == set(src) and torch.equal(sd['blk.other.weight'], src['blk.other.weight'])
    assert cq.validate(str(out)).ok
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        assert cli_main(['convert', str(path), str(tmp_path / 'cli.safetensors')]) == 0
    assert 'rewritten as exact zeros: blk.proj' in capsys.readouterr().out


@pytest.mark.parametrize('fmt', sorted(cq.FORMATS))
def test_cquant_all_zero_weight_every_format(tmp_path, fmt):
    "cquant's own encoding of an all-zero weight, in every format, is a valid file that loads as exact zeros."
    q = cq.quantize(torch.zeros(128, 256, dtype=torch.bfloat16), fmt)
    path = write(tmp_path, q.state_dict(P), q.config)
    with warnings.catch_warnings():
        warnings.simplefilter('error', QuantFormatWarning)       # nothing unusual in cquant's own files
        w = cq.load_quantized(cq.load_file(str(path)), NAME, (128, 256), torch.float32).dequantize()
    assert bool((w == 0).all()), f"{fmt}: {w.unique()}"


@pytest.mark.parametrize('layout,kw,fmt', [('TensorCoreMXFP8Layout', {}, 'mxfp8'), ('TensorWiseINT8Layout', {}, 'int8_tensorwise')])
def test_kitchen_all_zero_weight_loads(tmp_path, layout, kw, fmt):
    "comfy-kitchen's all-zero MXFP8 and INT8 encodings hold no NaN: they load as exact zeros."
    sd = dict(KQT.from_float(torch.zeros(SHAPE, dtype=torch.bfloat16), layout, **kw).state_dict(P + 'weight'))
    w = cq.load_quantized(cq.load_file(str(write(tmp_path, sd, {'format': fmt}))), NAME, SHAPE, torch.float32).dequantize()
    assert bool((w == 0).all())
