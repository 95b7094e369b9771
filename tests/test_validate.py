"""`cq.validate` and `cquant validate` (issue 21): each check with its message, levels, device classes, strict,
sharded folders, unreadable files, the CLI's exit codes and JSON, and the conftest helper that finds written files."""
import json, subprocess, sys
from pathlib import Path

import pytest
import torch

import cquant as cq
from cquant.checkpoint import _expand_quantized, encode_json, save_file
from cquant.validate import COMFYUI_LEVELS, DEVICE_CLASSES, device_table, format_validation, validate
from conftest import CLI_ENV as ENV, ROOT, cquant_cli, written_checkpoints

W = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
NONE = []   # no device class: no device warnings


def tensors(fmt, name='m', **options) -> dict:
    "The file tensors of one module `name` quantized to `fmt`."
    return _expand_quantized({f'{name}.weight': cq.quantize(W, fmt, **options)}, 'test')


def write(tmp_path, sd, name='x.safetensors') -> Path:
    save_file(sd, tmp_path / name, validate=False)
    return tmp_path / name


def messages(r) -> list: return [(m['status'], m['message']) for x in r.rows for m in x['messages']]


def test_a_good_file(tmp_path):
    sd = {**tensors('float8_e4m3fn', 'a'), **tensors('int8_tensorwise', 'b', convrot=True), 'c.weight': W.bfloat16(),
          'c.bias': torch.zeros(64)}
    r = validate(write(tmp_path, sd), devices=['cuda sm 9.0'])
    assert r.ok and r.errors == [] and r.warnings == [] and r.comfyui == '2026-10'
    assert [(x['module'], x['format'], x['status']) for x in r.rows] == [
        ('a', 'float8_e4m3fn', 'ok'), ('b', 'int8_tensorwise', 'ok'), ('c', None, 'ok')]
    assert r.totals() == {'ok': 3, 'warning': 0, 'error': 0}
    assert format_validation(r).endswith('3 modules: 3 ok, 0 with warnings, 0 with errors: OK')


@pytest.mark.writes_invalid
def test_misspelled_format_suggests_the_registered_name(tmp_path):
    r = validate(write(tmp_path, {**tensors('nvfp4'), 'm.comfy_quant': encode_json({'format': 'nvfp5'})}))
    assert not r.ok and len(r.errors) == 1
    assert r.errors[0].startswith("m: 'm.comfy_quant[\"format\"]': expected one of [") and "found 'nvfp5' (did you mean 'nvfp4'" in r.errors[0]
    assert r.rows[0]['format'] == 'nvfp5'


@pytest.mark.writes_invalid
def test_missing_format_and_markers_that_are_not_json(tmp_path):
    fp8 = tensors('float8_e4m3fn')
    r = validate(write(tmp_path, {**fp8, 'm.comfy_quant': encode_json({'fmt': 'float8_e4m3fn'})}, 'a.safetensors'))
    assert r.errors == ["m: 'm.comfy_quant': expected a \"format\" field, found keys ['fmt']"]
    r = validate(write(tmp_path, {**fp8, 'm.comfy_quant': torch.zeros(16, dtype=torch.uint8)}, 'b.safetensors'))
    assert len(r.errors) == 1 and r.errors[0].startswith("m: 'm.comfy_quant': expected valid JSON, found Expecting value at char 0")
    assert r.errors[0].endswith('(all 16 bytes are NUL: the writer reserved the entry and never filled it)')
    r = validate(write(tmp_path, {**fp8, 'm.comfy_quant': torch.tensor(list(b'{"format": '), dtype=torch.uint8)}, 'c.safetensors'))
    assert len(r.errors) == 1 and 'expected valid JSON' in r.errors[0] and 'NUL' not in r.errors[0]


def test_weight_correction_is_a_key_comfyui_ignores(tmp_path):
    f = write(tmp_path, tensors('asym_w4a8_int8', symmetric=False, codebook=False))
    r = validate(f, devices=NONE)
    assert r.ok and r.warnings == ["m: 'm.weight_correction': ComfyUI's loader never reads it, so the module decodes wrongly there"]
    s = validate(f, strict=True, devices=NONE)
    assert not s.ok and s.errors == r.warnings and s.warnings == [] and s.rows[0]['status'] == 'error'
    assert validate(write(tmp_path, tensors('asym_w4a8_int8'), 's.safetensors'), devices=NONE).warnings == []


def test_levels(tmp_path):
    f = write(tmp_path, tensors('w6a8_int8'))
    for level, ok in (('2026-08', False), ('2026-09', True), ('2026-10', True), (None, True)):
        assert validate(f, comfyui=level, devices=NONE).ok == ok, level
    assert validate(f, comfyui='2026-08', devices=NONE).errors == [
        "m: w6a8_int8: needs a newer ComfyUI loader: grouped 6-bit int8 weights (ComfyUI PR #16483, merged 2026-09-29); "
        "a --comfyui 2026-08 loader has no QUANT_ALGOS entry for it (loading raises KeyError)"]
    assert validate(write(tmp_path, tensors('nvfp4'), 'n.safetensors'), comfyui='2026-08', devices=NONE).ok
    with pytest.raises(ValueError, match=r"comfyui: expected one of the known ComfyUI loader levels \['2026-08', '2026-09', '2026-10'\], found '2025-10'"):
        validate(f, comfyui='2025-10')
    assert list(COMFYUI_LEVELS) == ['2026-08', '2026-09', '2026-10']


def test_every_format_declares_its_level():
    "Each format ComfyUI's core loader registers names a level, or the snapshot it is present in (no guessed date)."
    for n, s in cq.FORMATS.items():
        if s.loader.registered: assert s.loader.since in COMFYUI_LEVELS or s.loader.since.startswith('present in '), n
    assert cq.FORMATS['w6a8_int8'].loader.since == '2026-09' and cq.FORMATS['awq_w4a16'].loader.since.startswith('present in ')


def test_undated_and_unregistered_formats_warn(tmp_path):
    r = validate(write(tmp_path, tensors('awq_w4a16')), devices=NONE)
    assert r.ok and len(r.warnings) == 1
    assert r.warnings[0].startswith('m: awq_w4a16: no dated ComfyUI loader level registers it; present in ComfyUI comfy/quant_ops.py @ 0271a469')
    r = validate(write(tmp_path, tensors('svdquant_w4a4'), 's.safetensors'), devices=NONE)
    assert r.ok and r.warnings == ["m: svdquant_w4a4: ComfyUI's core loader does not register it (no QUANT_ALGOS entry: loading "
                                   "raises KeyError); cquant's module layer and comfy-kitchen read it"]


def test_attention_preferences_by_level(tmp_path):
    lst = [{'attention': 'comfy_kitchen_sol', 'tau': 2.0}, {'attention': 'comfy_kitchen_int8'}]
    f = write(tmp_path, {**tensors('float8_e4m3fn'), 'm.comfy_attention.config': encode_json(lst)})
    assert validate(f, devices=NONE).warnings == []
    r = validate(f, comfyui='2026-09', devices=NONE)
    assert r.ok and r.warnings == ["m: 'm.comfy_attention.config': a list of attention preferences needs attention preference lists "
                                   "and comfy_kitchen_sol (ComfyUI #16831 / #16880, merged 2026-10-05..09); a --comfyui 2026-09 loader ignores it"]
    g = write(tmp_path, {**tensors('float8_e4m3fn'), 'm.comfy_attention.config': encode_json({'attention': 'comfy_kitchen_sol'})}, 's.safetensors')
    assert "attention method 'comfy_kitchen_sol' needs attention preference lists" in validate(g, comfyui='2026-08', devices=NONE).warnings[0]
    h = write(tmp_path, {**tensors('float8_e4m3fn'), 'm.comfy_attention.config': encode_json({'attention': 'comfy_kitchen_int8'})}, 'i.safetensors')
    assert validate(h, devices=NONE).warnings == []
    assert validate(h, comfyui='2026-08', devices=NONE).warnings == [
        "m: 'm.comfy_attention.config': single-object attention preferences are present in ComfyUI comfy/ldm/modules/attention.py "
        "@ 05080f60 (undated; absent @ 82997188): a --comfyui 2026-08 loader may not read the key (then it is an unexpected key)"]
    u = write(tmp_path, {**tensors('float8_e4m3fn'), 'm.comfy_attention.config': encode_json([{'attention': 'flash'}])}, 'u.safetensors')
    assert validate(u, devices=NONE).warnings == [
        "m: 'm.comfy_attention.config'[0]: ComfyUI skips the unknown attention method 'flash' (known: ['comfy_kitchen_int8', 'comfy_kitchen_sol'])"]


@pytest.mark.writes_invalid
def test_options_the_loader_reads_differently(tmp_path):
    sd = {**tensors('int8_tensorwise', convrot=True),
          'm.comfy_quant': encode_json({'format': 'int8_tensorwise', 'convrot': 'false', 'convrot_groupsize': 256.5})}
    r = validate(write(tmp_path, sd), devices=NONE)
    assert r.errors == ["m: 'm.comfy_quant[\"convrot\"]': expected bool, found str 'false'; ComfyUI's loader uses it as a flag: 'false' counts as True",
                        "m: 'm.comfy_quant[\"convrot_groupsize\"]': expected int, found float 256.5; ComfyUI's loader reads int(256.5) = 256"]
    sd = {**tensors('float8_e4m3fn'), 'm.comfy_quant': encode_json({'format': 'float8_e4m3fn', 'full_precision_matrix_mult': 0})}
    assert validate(write(tmp_path, sd, 'f.safetensors'), devices=NONE).errors == [
        "m: 'm.comfy_quant[\"full_precision_matrix_mult\"]': expected bool, found int 0; ComfyUI's loader uses it as a flag: 0 counts as False"]
    awq = tensors('awq_w4a16')
    cfg = json.loads(bytes(awq['m.comfy_quant'].tolist()))
    sd = {**awq, 'm.comfy_quant': encode_json({'format': 'awq_w4a16', 'params': {'group_size': cfg.get('group_size', 64)}})}
    r = validate(write(tmp_path, sd, 'a.safetensors'), devices=NONE)
    assert r.ok and "m: 'm.comfy_quant[\"params\"][\"group_size\"]': ignored, ComfyUI reads group_size from the top level only" in r.warnings[0]


def test_device_classes(tmp_path):
    f = write(tmp_path, {**tensors('float8_e4m3fn', 'a'), **tensors('nvfp4', 'b'), **tensors('int8_tensorwise', 'c')})
    r = validate(f)
    assert r.ok and r.warnings == [
        'a: float8_e4m3fn: ComfyUI computes it dequantized (full-precision matmul) on cpu, cuda sm<8.9, mps, xpu',
        'b: nvfp4: ComfyUI computes it dequantized (full-precision matmul) on cpu, cuda sm<10.0, mps, xpu',
        'c: int8_tensorwise: ComfyUI computes it dequantized (full-precision matmul) on mps, xpu']
    assert validate(f, devices=['cuda sm 8.6']).warnings == [
        'a: float8_e4m3fn: ComfyUI computes it dequantized (full-precision matmul) on cuda sm 8.6',
        'b: nvfp4: ComfyUI computes it dequantized (full-precision matmul) on cuda sm 8.6']
    assert validate(f, devices=['cuda sm 12.0']).warnings == []
    with pytest.raises(ValueError, match=r"devices: expected device classes from \['cpu', 'cuda sm 8.0'.*found \['sm86'\]"):
        validate(f, devices=['sm86'])
    t = device_table()
    assert list(t) == list(DEVICE_CLASSES) and t['cuda sm 12.0'] == frozenset()
    assert t['cuda sm 8.9'] == {'nvfp4', 'mxfp8'} and t['cuda sm 10.0'] == frozenset()


def test_device_table_is_the_registry_declaration():
    "One declaration: the table is each format's native_compute, as modules.comfy_disabled_formats asks it."
    for d, c in DEVICE_CLASSES.items():
        assert device_table(d)[d] == {n for n, s in cq.FORMATS.items() if not s.native_on(c)}, d


@pytest.mark.writes_invalid
def test_scan_errors_are_rows_not_tracebacks(tmp_path):
    sd = tensors('nvfp4'); del sd['m.weight_scale_2']
    r = validate(write(tmp_path, {**sd, **tensors('float8_e4m3fn', 'ok')}), devices=NONE)
    assert {x['module']: x['status'] for x in r.rows} == {'m': 'error', 'ok': 'ok'}
    assert r.errors == ["m: 'm.weight_scale_2': expected nvfp4 tensors ['weight', 'weight_scale', 'weight_scale_2'], found m.weight_scale_2 missing"]
    (tmp_path / 'junk.safetensors').write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": 1}        ')
    r = validate(tmp_path / 'junk.safetensors')
    assert [x['module'] for x in r.rows] == [''] and r.errors == [
        "(file): header entry 'a': expected an object with dtype, shape, data_offsets, found int"]
    r = validate(tmp_path / 'missing.safetensors')
    assert not r.ok and 'missing.safetensors' in r.errors[0]


def test_sharded_folder_and_index(tmp_path):
    from test_shards import write_shards
    sd = {**tensors('float8_e4m3fn', 'a'), **tensors('int8_tensorwise', 'b'), **tensors('w6a8_int8', 'c')}
    ix = write_shards(tmp_path / 'dit', sd, 2)
    for p in (ix, ix.parent):
        r = validate(p, devices=NONE)
        assert r.ok and r.file == str(ix) and sorted(x['module'] for x in r.rows) == ['a', 'b', 'c']
    assert validate(ix, comfyui='2026-08', devices=NONE).errors[0].startswith('c: w6a8_int8: needs a newer ComfyUI loader')
    assert written_checkpoints(tmp_path) == [str(ix)]
    write(tmp_path, tensors('nvfp4'), 'one.safetensors')
    assert written_checkpoints(tmp_path) == [str(ix), str(tmp_path / 'one.safetensors')]


@pytest.mark.writes_invalid
def test_a_state_dict_and_the_report_dict(tmp_path):
    r = validate({**tensors('float8_e4m3fn'), 'm.comfy_quant': encode_json({'format': 'fp9'})})
    d = r.to_dict()
    assert (d['file'], d['ok'], d['errors'], d['warnings'], d['totals']) == ('state dict', False, 1, 0, {'ok': 0, 'warning': 0, 'error': 1})
    assert d['modules'][0]['messages'][0]['status'] == 'error' and set(d['modules'][0]) == {'module', 'format', 'status', 'messages'}
    write(tmp_path, {**tensors('float8_e4m3fn'), 'm.comfy_quant': encode_json({'format': 'fp9'})})   # left behind on purpose


def cquant(*argv): return cquant_cli('validate', *argv)


@pytest.mark.long
def test_cli_exit_codes_text_and_json(tmp_path):
    good = write(tmp_path, tensors('w6a8_int8'), 'good.safetensors')
    asym = write(tmp_path, tensors('asym_w4a8_int8', symmetric=False, codebook=False), 'asym.safetensors')
    rc, out, err = cquant(good, asym, '--device', 'cuda sm 9.0')
    assert rc == 0 and err == '' and out.rstrip().endswith('2 files: 2 ok, 0 failed')
    assert "asym_w4a8_int8  warning  'm.weight_correction': ComfyUI's loader never reads it" in out
    rc, out, _ = cquant(good, asym, '--strict', '--device', 'cuda sm 9.0', '--json')
    d = json.loads(out)
    assert rc == 1 and set(d) == {'ok', 'comfyui', 'strict', 'files'} and (d['ok'], d['comfyui'], d['strict']) == (False, '2026-10', True)
    assert [(f['ok'], f['errors']) for f in d['files']] == [(True, 0), (False, 1)]
    rc, out, _ = cquant(good, '--comfyui', '2026-08', '--json')
    assert rc == 1 and json.loads(out)['files'][0]['modules'][0]['status'] == 'error'
    rc, out, err = cquant(good, '--comfyui', '2025-10')
    assert rc == 2 and out == '' and "expected a ComfyUI loader level from ['2026-08', '2026-09', '2026-10'], found '2025-10'" in err
    assert cquant(good, '--device', 'sm86')[0] == 2 and cquant()[0] == 2
    assert cquant(tmp_path / 'nothing.safetensors')[0] == 1


@pytest.mark.long
def test_the_conftest_fixture_fails_a_test_that_leaves_a_broken_file(tmp_path):
    "The autouse fixture is not vacuous: a broken file left in tmp_path fails its test, unless marked writes_invalid."
    (tmp_path / 'conftest.py').write_text((ROOT / 'tests' / 'conftest.py').read_text())
    (tmp_path / 'test_leaves.py').write_text(
        "import pytest, torch, cquant as cq\n"
        "def broken(tmp_path):\n"
        "    sd = {'m.weight': torch.zeros(4, 4, dtype=torch.int8), 'm.comfy_quant': cq.encode_json({'format': 'int9'})}\n"
        "    cq.save_file(sd, tmp_path / 'b.safetensors', validate=False)\n"
        "def test_unmarked(tmp_path): broken(tmp_path)\n"
        "@pytest.mark.writes_invalid\n"
        "def test_marked(tmp_path): broken(tmp_path)\n"
        "def test_good(tmp_path): cq.save_file({'m.weight': cq.quantize(torch.randn(16, 64), 'nvfp4')}, tmp_path / 'g.safetensors')\n")
    p = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-W', 'ignore::pytest.PytestUnknownMarkWarning',
                        str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert p.returncode == 1, p.stdout
    assert 'cquant validate: errors in files this test wrote' in p.stdout and "found 'int9'" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith('3 passed, 1 error'), p.stdout[-2000:]   # the teardown of test_unmarked


@pytest.mark.writes_invalid
def test_convert_rewrites_wrongly_written_markers(tmp_path):
    """Files other tools wrote wrongly (issue 40): `cquant convert` rewrites a marker without its format, or naming the
    wrong one, where one format loads the tensors, keeping every data byte; it refuses integer codes without a marker
    and writes nothing."""
    from safetensors.torch import load_file, save_file as st_save
    cr = cq.quantize(torch.randn(64, 256), 'int8_tensorwise', convrot=True).state_dict('m.')
    rows = cq.quantize(torch.randn(64, 64), 'int8_tensorwise', per_row=True).state_dict('r.')
    src = tmp_path / 'wrong.safetensors'
    st_save({**cr, 'm.comfy_quant': encode_json({'convrot': True}), **rows, 'r.comfy_quant': encode_json({'format': 'float8_e4m3fn'}),
             'n.weight': torch.randn(8, 8)}, src)
    assert validate(src).totals()['error'] == 2
    rc, out, err = cquant_cli('convert', src, tmp_path / 'fixed.safetensors')
    assert rc == 0, err
    assert 'markers rewritten: m -> {"format": "int8_tensorwise", "params": {"convrot": true}}, r -> {"format": "int8_tensorwise"}' in out
    assert err.count('rewritten as') == 2
    assert validate(tmp_path / 'fixed.safetensors').totals()['error'] == 0
    a, b = load_file(src), load_file(tmp_path / 'fixed.safetensors')
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a if not k.endswith('comfy_quant'))
    codes = tmp_path / 'codes.safetensors'              # legacy INT8: codes and a per-row scale_weight, no marker
    st_save({'m.weight': rows['r.weight'], 'm.scale_weight': rows['r.weight_scale'], 'k.weight': rows['r.weight'].clone()}, codes)
    rc, out, err = cquant_cli('convert', codes, tmp_path / 'no.safetensors')    # k: bare codes, nothing to read them by
    assert rc == 1 and "'k.weight': int8 codes and no 'k.comfy_quant'" in err
    assert "  m:" not in err and not (tmp_path / 'no.safetensors').exists()


@pytest.mark.writes_invalid
def test_convert_requantizes_group_scaled_fp8(tmp_path):
    """convert_to_quant's old block3d files (FP8 codes, one scale per 32 inputs of a row, marked float8_e4m3fn): validate
    explains them, `cquant convert` quantizes them again as the named format and prints the SQNR it measured."""
    from safetensors.torch import save_file as st_save
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g)
    m = 448 / w.view(64, 4, 32).abs().amax(2, keepdim=True)
    codes = (w.view(64, 4, 32) * m).clamp(-448, 448).to(torch.float8_e4m3fn).view(64, 128)
    src = tmp_path / 'b3.safetensors'
    st_save({'z.weight': codes, 'z.weight_scale': 1 / m, 'z.comfy_quant': encode_json({'format': 'float8_e4m3fn'})}, src)
    msg = validate(src).rows[0]['messages'][0]['message']
    assert 'one scale per 32 inputs of a row' in msg and '`cquant convert` re-quantizes it as float8_e4m3fn' in msg
    rc, out, err = cquant_cli('convert', src, tmp_path / 'fp8.safetensors')
    assert rc == 0, err
    db = float(out.split('quantized again: z -> float8_e4m3fn (')[1].split(' dB)')[0])
    decoded = (codes.float().view(64, 4, 32) / m).view(64, 128)
    assert abs(db - cq.sqnr(decoded, cq.load_quantized(cq.load_file(tmp_path / 'fp8.safetensors'), 'z').dequantize(torch.float32))) < 0.01
    assert validate(tmp_path / 'fp8.safetensors').totals()['error'] == 0


def test_validating_every_format_stays_off_torchs_python_meta_kernels(tmp_path):
    """The validator builds each module from meta tensors first; a check that needs values (a finite zero point, say)
    defers to the real scales instead of running on meta, which imports torch's Python meta kernels (sympy, dynamo:
    about 900 modules and 145 MiB, inside every job that wrote such a format)."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    path = write(tmp_path, _expand_quantized({f'm_{f}.weight': cq.quantize(w, f) for f in cq.FORMATS}, 'test'))
    code = ("import sys, cquant as cq\nr = cq.validate(sys.argv[1])\n"
            "print(len(r.rows), sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))")
    r = subprocess.run([sys.executable, '-c', code, str(path)], capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split('\n')[-2] == f'{len(cq.FORMATS)} []'
