"""The Python API as people use it (issue 14): what `cq.load_quantized_model`, `cq.quantize` and `cq.load_quantized`
return and say when called the way a first hour calls them.

- `cq.load_quantized_model(model, sd)` returns the model (SPEC §4), so `.eval()` chains; mismatched keys raise a
  `LoadKeysError` listing them by module (strict=True) or warn with the same text (strict=False), the lists on
  `model.load_result`.
- A policy mode or short name passed as a format (`cq.quantize(w, "fp8")`) names the argument and the format; a
  misspelt name gets the closest formats; a file's unknown format still names its `comfy_quant` key.
- `cq.load_quantized(sd, "x.dense")` reads `x.dense.weight`: the prefix's trailing dot is optional.
"""
import warnings
import pytest
import torch
import torch.nn as nn

import cquant as cq
from cquant.policy import MODES
from cquant.tensor import same_bits
from cquant.modules import key_report


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 16)
    def forward(self, x): return self.fc2(self.fc1(x).relu())


@pytest.fixture
def saved():
    torch.manual_seed(0)
    net = cq.quantize_model(Net(), {'fc1': 'float8_e4m3fn', 'fc2': 'int8_tensorwise'})
    return net, net.state_dict()


def test_load_quantized_model_returns_the_model(saved):
    net, sd = saved
    fresh = Net().train()
    m = cq.load_quantized_model(fresh, sd).eval()
    assert m is fresh and not m.training
    assert (m.load_result.missing_keys, m.load_result.unexpected_keys) == ([], [])
    assert type(m.fc1).__name__ == 'QuantLinear' and m.fc1.format == 'float8_e4m3fn'
    x = torch.randn(3, 64)
    with torch.no_grad(): assert same_bits(m(x), net(x))


def test_mismatched_keys_strict_error_lists_them_by_module(saved):
    _, sd = saved
    bad = {k: v for k, v in sd.items() if k not in ('fc1.bias', 'fc2.bias')}
    bad |= {'fc2.input_scale': torch.tensor(1.0), 'head.comfy_quant': cq.encode_json({'format': 'nvfp4'})}
    with pytest.raises(cq.LoadKeysError) as err: cq.load_quantized_model(Net(), bad)
    assert str(err.value) == (
        "load_quantized_model: the state dict for Net does not match the model:\n"
        "  2 missing key(s) in 2 module(s) (the model has them, the state dict does not):\n"
        "    fc1: bias\n"
        "    fc2: bias\n"
        "  2 unexpected key(s) in 2 module(s) (the state dict has them, the model does not):\n"
        "    fc2: input_scale\n"
        "    head: comfy_quant\n"
        "(strict=False loads it anyway, with a warning; the lists are then on model.load_result)")
    assert isinstance(err.value, RuntimeError)
    assert (err.value.missing_keys, sorted(err.value.unexpected_keys)) == (['fc1.bias', 'fc2.bias'], ['fc2.input_scale', 'head.comfy_quant'])


def test_mismatched_keys_lenient_warns_and_loads(saved):
    net, sd = saved
    bad = {k: v for k, v in sd.items() if k != 'fc1.bias'} | {'stray.weight': torch.zeros(2)}
    with pytest.warns(cq.LoadKeysWarning) as w: m = cq.load_quantized_model(Net(), bad, strict=False)
    assert str(w[0].message) == (
        "load_quantized_model: the state dict for Net does not match the model:\n"
        "  1 missing key(s) in 1 module(s) (the model has them, the state dict does not):\n"
        "    fc1: bias\n"
        "  1 unexpected key(s) in 1 module(s) (the state dict has them, the model does not):\n"
        "    stray: weight")
    assert (m.load_result.missing_keys, m.load_result.unexpected_keys) == (['fc1.bias'], ['stray.weight'])
    assert same_bits(m.fc2.weight.qdata, net.fc2.weight.qdata)            # everything else loaded
    with warnings.catch_warnings():
        warnings.simplefilter('error')                                    # a matching state dict warns nothing
        cq.load_quantized_model(Net(), sd, strict=False)


def test_key_report_groups_and_truncates():
    res = nn.Linear(2, 2).load_state_dict({f'm{i}.weight': torch.zeros(1) for i in range(5)} | {'top': torch.zeros(1)}, strict=False)
    text = key_report(res, 'x', limit=2)
    assert text.splitlines()[3:] == ['  6 unexpected key(s) in 6 module(s) (the state dict has them, the model does not):',
                                     '    (root): top', '    m0: weight', '    ... and 4 more module(s)']
    assert text.splitlines()[:3] == ['x does not match the model:',
                                     '  2 missing key(s) in 1 module(s) (the model has them, the state dict does not):',
                                     '    (root): weight, bias']


def test_policy_mode_as_format():
    w = torch.randn(32, 64)
    with pytest.raises(cq.QuantFormatError) as err: cq.quantize(w, 'fp8')
    assert str(err.value) == "cq.quantize: format 'fp8' is a policy mode or short name; the format is 'float8_e4m3fn'"
    for mode, fmt in [('int8', 'int8_tensorwise'), ('int8_convrot', 'int8_tensorwise'), ('int4_full', 'convrot_w4a4'),
                      ('int4_mixed', 'convrot_w4a4'), ('w4a8', 'asym_w4a8_int8'), ('w6a8', 'w6a8_int8'), ('e5m2', 'float8_e5m2'),
                      ('svdquant', 'svdquant_w4a4'), ('awq', 'awq_w4a16')]:
        with pytest.raises(cq.QuantFormatError, match=f"format '{mode}' is a policy mode or short name; the format is '{fmt}'$"):
            cq.quantize(w, mode)


def test_every_policy_mode_is_a_format_or_an_alias():
    aliases = {a for s in cq.FORMATS.values() for a in s.aliases}
    assert [m for m in MODES if m not in cq.FORMATS and m not in aliases] == []


def test_unknown_format_suggests_the_closest():
    w = torch.randn(32, 64)
    names = sorted(cq.FORMATS)
    with pytest.raises(cq.QuantFormatError) as err: cq.quantize(w, 'flaot8')
    assert str(err.value) == f"cq.quantize: unknown format 'flaot8'; did you mean 'float8_e4m3fn' or 'float8_e5m2' or 'float8_e4m3fn_rowwise'? registered formats: {names}"
    with pytest.raises(cq.QuantFormatError) as err: cq.quantize(w, 'NVFP4')
    assert str(err.value) == f"cq.quantize: unknown format 'NVFP4'; did you mean 'nvfp4'? registered formats: {names}"
    with pytest.raises(cq.QuantFormatError) as err: cq.quantize(w, 'zzzz')
    assert str(err.value) == f"cq.quantize: unknown format 'zzzz'; registered formats: {names}"
    with pytest.raises(cq.QuantFormatError) as err: cq.quantize(w, None)
    assert str(err.value) == "cq.quantize: format must be a format name (str) or a Format, got NoneType None"
    with pytest.raises(cq.QuantFormatError) as err: cq.QuantLinear.from_float(nn.Linear(64, 32), 'fp8')
    assert str(err.value).startswith("QuantLinear.quantize_: format 'fp8' is a policy mode")


def test_file_format_error_names_the_key():
    sd = {'blk.weight': torch.zeros(4, 4, dtype=torch.float8_e4m3fn), 'blk.weight_scale': torch.tensor(1.0),
          'blk.comfy_quant': cq.encode_json({'format': 'fp8'})}
    with pytest.raises(cq.QuantFormatError) as err: cq.load_quantized(sd, 'blk.')
    assert str(err.value) == (f"""'blk.comfy_quant["format"]': expected one of {sorted(cq.FORMATS)}, found 'fp8' """
                              "('fp8' is a policy mode or short name; the format is 'float8_e4m3fn')")


@pytest.mark.parametrize('prefix', ['x.dense', 'x.dense.'])
def test_load_quantized_prefix_with_or_without_dot(prefix):
    qt = cq.quantize(torch.randn(32, 64), 'float8_e4m3fn')
    sd = {**qt.state_dict('x.dense.'), 'x.dense.comfy_quant': cq.encode_json(qt.config)}
    back = cq.load_quantized(sd, prefix, shape=(32, 64), dtype=torch.float32)
    assert same_bits(back.dequantize(), qt.dequantize(torch.float32))
    root = cq.load_quantized({k[len('x.dense.'):]: v for k, v in sd.items()}, '', shape=(32, 64), dtype=torch.float32)
    assert same_bits(root.dequantize(), back.dequantize())
    assert cq.read_comfy_quant(sd, prefix) == {'format': 'float8_e4m3fn'}


def test_submodule_imports_find_the_whole_api():
    """`import cquant` is lazy (issue 42: the CLI answers without torch), yet a program that imports only submodules
    sees what `import cquant` gave before: every format registered, the recipe methods on `Policy`, the roundings; and
    `cq.validate` / `cq.explore` stay the functions after their submodules are imported."""
    import subprocess, sys
    code = """import sys
import cquant
assert 'torch' not in sys.modules, 'import cquant imports torch'
from cquant.tensor import FORMATS, ROUNDINGS, quantize
from cquant.policy import Policy
import torch
assert quantize(torch.randn(16, 64), 'nvfp4').format == 'nvfp4'
import cquant.validate, cquant.explore, cquant as cq
print(len(FORMATS), sorted(ROUNDINGS), hasattr(Policy, 'from_recipe'), callable(cq.validate), callable(cq.explore))"""
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(len(cq.FORMATS)), "['exact',", "'gptq',", "'mse']", 'True', 'True', 'True'], r.stdout
