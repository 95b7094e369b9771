"""Architecture rules of issue 15: every per-format fact lives in the format's declaration, and nothing outside
the format modules tests a format's name."""
import ast
from pathlib import Path
import pytest
import torch
import cquant as cq
from cquant import comfy, modules, tensor
from cquant.calibrate import search_smoothing

PKG = Path(cq.__file__).parent
FORMAT_MODULES = {'fp8.py', 'nvfp4.py', 'mxfp8.py', 'int8.py', 'w4a4.py', 'w4a8.py', 'tensor.py', '_modidx.py'}
# (file, top-level name assigned) -> why a format name may appear there as a string constant
ALLOWED = {
    # the CLI's mode names 'nvfp4' and 'mxfp8' are mode vocabulary (data) that happen to equal their format's name;
    # each mode's formats are named through the format declarations (NVFP4.name, ...), never as strings
    ('policy.py', 'MODES'),
}


def _assigned(stmt) -> set:
    "Names a top-level statement binds (assignments, defs, classes)."
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return {stmt.name}
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def format_name_constants() -> list:
    "`file:line: name` of every string constant equal to a registered format name outside the format modules."
    names, hits = set(cq.FORMATS), []
    for p in sorted(PKG.glob('*.py')):
        if p.name in FORMAT_MODULES: continue
        for stmt in ast.parse(p.read_text(), str(p)).body:
            if any((p.name, n) in ALLOWED for n in _assigned(stmt)): continue
            hits += [f'{p.name}:{n.lineno}: {n.value!r}' for n in ast.walk(stmt)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]
    return hits


def test_no_format_names_outside_format_modules():
    hits = format_name_constants()
    assert not hits, 'format names outside the format modules (ask cquant.tensor.FORMATS instead):\n' + '\n'.join(hits)


def test_the_check_finds_a_name(tmp_path, monkeypatch):
    "The scanner is not vacuous: a planted name test is reported with its line."
    (tmp_path / 'planted.py').write_text("x = 1\nif x == 'nvfp4': pass\n")
    monkeypatch.setattr(f'{__name__}.PKG', tmp_path)
    assert format_name_constants() == ["planted.py:2: 'nvfp4'"]


def test_declared_facts_reproduce_the_old_tables():
    "The declarations give exactly what the removed side tables said (behaviour unchanged)."
    F = cq.FORMATS
    flag = lambda fact: {n for n, s in F.items() if getattr(s, fact)}
    assert flag('row_gather') == flag('embedding') == {'float8_e4m3fn', 'float8_e5m2', 'int8_tensorwise'}
    assert {n for n, s in F.items() if s.rows_independent({})} == {'convrot_w4a4', 'asym_w4a8_int8', 'w6a8_int8'}
    assert F['int8_tensorwise'].rows_independent({'convrot': True}) and F['int8_tensorwise'].rows_independent({'per_row': True})
    assert {n for n, s in F.items() if s.bank_is_flat({})} == {'asym_w4a8_int8', 'w6a8_int8'}
    i8 = F['int8_tensorwise']
    assert i8.bank_is_flat({'per_row': True}) and not i8.bank_is_flat({'per_row': True}, {'weight_scale': torch.ones(())})
    assert i8.bank_is_flat({}, {'weight_scale': torch.ones(2, 3, 1)})
    assert {n: s.row_assembly for n, s in F.items() if s.row_assembly} == {
        'asym_w4a8_int8': {'weight_codebook': 'shared', 'weight_correction': 1}}
    assert {n: s.input_scale_rule.divisor for n, s in F.items() if s.input_scale_rule} == {
        'float8_e4m3fn': 448.0, 'float8_e5m2': 57344.0, 'nvfp4': 2688}
    assert flag('smoothing') == {'nvfp4'} and flag('dynamic_reason') == {'mxfp8'}
    assert {n: s.comfy_unread for n, s in F.items() if s.comfy_unread} == {'asym_w4a8_int8': ('weight_correction',)}
    assert [l for _, s in F.items() for l, _ in s.study_variants] == ['int8_per_row', 'int8_convrot16', 'int8_convrot64', 'int8_convrot256']


def test_native_compute_follows_comfyui(monkeypatch):
    "ComfyUI's disabled formats per device, from each format's native_compute (CUDA faked: capability and torch version)."
    every = set(cq.FORMATS)
    ints = {'int8_tensorwise', 'convrot_w4a4', 'asym_w4a8_int8', 'w6a8_int8'}
    assert modules.comfy_disabled_formats('cpu') == every - ints
    assert modules.comfy_disabled_formats('xpu') == every
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.version, 'cuda', '12.8')
    for cc, tv, off in [((8, 6), (2, 9), every - ints), ((8, 9), (2, 9), {'nvfp4', 'mxfp8'}),
                        ((10, 0), (2, 9), {'mxfp8'}), ((12, 0), (2, 10), set()), ((8, 9), (2, 2), every - ints)]:
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda d=None, cc=cc: cc)
        monkeypatch.setattr(tensor, 'torch_version', lambda tv=tv: tv)
        assert modules.comfy_disabled_formats('cuda') == off, (cc, tv)


def test_min_sm_version_matches_kitchen():
    ck = pytest.importorskip('comfy_kitchen.tensor')
    for n, s in cq.FORMATS.items():
        assert s.layout.MIN_SM_VERSION == getattr(ck, s.kitchen_layout).MIN_SM_VERSION, n


def test_one_comfy_quant_check():
    "tensor.load_quantized, comfy.read_comfy_quant and the checkpoint scan share check_comfy_quant's messages."
    sd = {'m.comfy_quant': cq.encode_json(['nvfp4']), 'm.weight': torch.zeros(2, 2)}
    for f in (lambda: cq.load_quantized(sd, 'm'), lambda: comfy.read_comfy_quant(sd, 'm')):
        with pytest.raises(cq.QuantFormatError, match=r"'m\.comfy_quant': expected a JSON object, found list \['nvfp4'\]"): f()
    with pytest.raises(cq.QuantFormatError, match='expected a "format" field, found keys'): tensor.check_comfy_quant({'params': {}}, 'm.')


def test_plan_entry_is_the_one_normaliser():
    pe = modules.plan_entry
    assert pe(None) == (None, {}, False, 'float')
    assert pe(('int8_tensorwise', {'per_row': True})) == ('int8_tensorwise', {'per_row': True}, False, 'int8_tensorwise')
    assert pe({'format': 'int8_tensorwise', 'convrot': True, 'full_precision_matrix_mult': True})[:3] == \
        ('int8_tensorwise', {'convrot': True}, True)
    with pytest.raises(cq.QuantFormatError, match='layer_sqnr: plan entry'): pe('fp8', 'layer_sqnr')


def test_smoothing_search_needs_a_declared_format():
    w, x = torch.randn(32, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="'float8_e4m3fn' declares no smoothing search"): search_smoothing(w, x, fmt='float8_e4m3fn')
