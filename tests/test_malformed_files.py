"Malformed checkpoints built in the test: every entry point rejects them with a message naming the key."
import json, math, os, struct, warnings
import pytest, safetensors.torch, torch
import cquant as cq
from cquant.cli import main

def raw_file(path, header:str, data:bytes=b''):
    "A safetensors file with the header text `header` (duplicate keys kept) and data section `data`."
    h = header.encode()
    with open(path, 'wb') as f: f.write(struct.pack('<Q', len(h)) + h + data)
    return path

def fp8_module(prefix:str, cq_json:str, offset:int=0) -> tuple[list, bytes]:
    "Header entries (as text) and data of one 2x16 float8_e4m3fn module whose comfy_quant bytes are `cq_json`."
    w, s, c = torch.ones(2, 16).to(torch.float8_e4m3fn), torch.ones((), dtype=torch.float32), cq_json.encode()
    ents, data, pos = [], b'', offset
    for k, dt, shape, b in (('weight', 'F8_E4M3', [2, 16], w.view(torch.uint8).numpy().tobytes()),
                            ('weight_scale', 'F32', [], s.numpy().tobytes()), ('comfy_quant', 'U8', [len(c)], c)):
        ents.append(f'"{prefix}{k}": {{"dtype": "{dt}", "shape": {json.dumps(shape)}, '
                    f'"data_offsets": [{pos}, {pos + len(b)}]}}')
        data, pos = data + b, pos + len(b)
    return ents, data

def module_file(path, cq_json:str, prefix:str='blk.', extra:list=(), meta:dict|None=None):
    ents, data = fp8_module(prefix, cq_json)
    if meta: ents = [f'"__metadata__": {json.dumps(meta)}'] + ents
    return raw_file(path, '{' + ', '.join(ents + list(extra)) + '}', data)

def readers(path):
    "Each file entry point, as a callable."
    return {'load_file': lambda: cq.load_file(path), 'open_checkpoint': lambda: cq.open_checkpoint(path).modules(),
            'inspect': lambda: _inspect(path)}

def _inspect(path):
    rc = main(['inspect', str(path)])
    if rc: raise ValueError(f'cquant inspect exit {rc}')

def assert_all_fail(path, match, capsys=None):
    for name, f in readers(path).items():
        if name == 'inspect' and capsys is not None:
            capsys.readouterr(); assert main(['inspect', str(path)]) == 1, name
            assert match in capsys.readouterr().err, name
        else:
            with pytest.raises(ValueError) as e: f()
            assert match in str(e.value), (name, str(e.value))

# 1. full_precision_matrix_mult must be JSON true/false
@pytest.mark.parametrize('v', ['"false"', '0', '1', 'null'])
@pytest.mark.writes_invalid
def test_fpmm_must_be_bool(tmp_path, capsys, v):
    p = module_file(tmp_path / 'a.safetensors', f'{{"format": "float8_e4m3fn", "full_precision_matrix_mult": {v}}}')
    assert_all_fail(p, 'blk.comfy_quant["full_precision_matrix_mult"]', capsys)
    assert_all_fail(p, 'expected JSON true or false', capsys)
    sd = {'blk.weight': torch.ones(2, 16).to(torch.float8_e4m3fn), 'blk.weight_scale': torch.ones(())}
    with pytest.raises(ValueError, match=r'full_precision_matrix_mult.*expected JSON true or false'):
        cq.load_quantized(sd, 'blk', config={'format': 'float8_e4m3fn', 'full_precision_matrix_mult': json.loads(v)})
    nested = {'format': 'float8_e4m3fn', 'params': {'full_precision_matrix_mult': json.loads(v)}}
    with pytest.raises(ValueError, match=r'comfy_quant\["params"\]\["full_precision_matrix_mult"\]'):
        cq.load_quantized(sd, 'blk', config=nested)

def test_fpmm_true_still_loads(tmp_path):
    p = module_file(tmp_path / 'a.safetensors', '{"format": "float8_e4m3fn", "full_precision_matrix_mult": true}')
    assert cq.load_file(p)['blk.weight'].shape == (2, 16)

# 2. duplicate keys
@pytest.mark.writes_invalid
def test_duplicate_comfy_quant_key(tmp_path, capsys):
    p = module_file(tmp_path / 'a.safetensors', '{"format": "float8_e4m3fn", "format": "nvfp4"}')
    assert_all_fail(p, "'blk.comfy_quant': expected a JSON object with distinct keys, found 'format' twice", capsys)

@pytest.mark.writes_invalid
def test_duplicate_tensor_name(tmp_path, capsys):
    ents, data = fp8_module('blk.', '{"format": "float8_e4m3fn"}')
    p = raw_file(tmp_path / 'a.safetensors', '{' + ', '.join(ents + [ents[1]]) + '}', data)
    assert_all_fail(p, "expected a JSON object with distinct keys, found 'blk.weight_scale' twice", capsys)

@pytest.mark.writes_invalid
def test_duplicate_qmeta_layer(tmp_path):
    meta = {'_quantization_metadata': '{"layers": {"blk": {"format": "float8_e4m3fn"}, "blk": {"format": "nvfp4"}}}'}
    p = module_file(tmp_path / 'a.safetensors', '{"format": "float8_e4m3fn"}', meta=meta)
    with pytest.raises(ValueError, match="_quantization_metadata.*found 'blk' twice"): cq.open_checkpoint(p)

# 3. _quantization_metadata must not override a comfy_quant of another format
@pytest.mark.writes_invalid
def test_qmeta_overrides_other_format(tmp_path, capsys):
    meta = {'_quantization_metadata': json.dumps({'layers': {'blk': {'format': 'float8_e5m2'}}})}
    p = module_file(tmp_path / 'a.safetensors', '{"format": "float8_e4m3fn"}', meta=meta)
    assert_all_fail(p, "layer 'blk': expected the format of the existing 'blk.comfy_quant' ('float8_e4m3fn'), "
                       "found 'float8_e5m2'", capsys)
    meta = {'_quantization_metadata': json.dumps({'layers': {'blk': {'format': 'float8_e4m3fn'}}})}
    p = module_file(tmp_path / 'b.safetensors', '{"format": "float8_e4m3fn"}', meta=meta)
    assert cq.load_file(p)['blk.weight'].shape == (2, 16)     # the same format: accepted

# 4. attention preferences
def attn_file(path, cfg:str):
    c = cfg.encode()
    ent = f'"blk.comfy_attention.config": {{"dtype": "U8", "shape": [{len(c)}], "data_offsets": [0, {len(c)}]}}'
    return raw_file(path, '{' + ent + '}', c)

def assert_all_warn(path, match, capsys):
    "Every entry point loads the file, warning `match` (ComfyUI drops a malformed attention hint and loads the rest)."
    for name, f in readers(path).items():
        if name == 'inspect':
            capsys.readouterr(); assert main(['inspect', str(path)]) == 0, name
            assert match in capsys.readouterr().err, name
        else:
            with pytest.warns(cq.CheckpointWarning) as got: f()
            assert any(match in str(w.message) for w in got), (name, [str(w.message) for w in got])

@pytest.mark.parametrize('tau', ['-1', '0', 'NaN', 'Infinity', '"1"', '"1.0"', 'true'])
@pytest.mark.writes_invalid
def test_attention_tau(tmp_path, capsys, tau):
    p = attn_file(tmp_path / 'a.safetensors', f'[{{"attention": "comfy_kitchen_sol", "tau": {tau}}}]')
    assert_all_warn(p, "Ignoring unsupported attention method 'comfy_kitchen_sol' for blk.comfy_attention: "
                       "'blk.comfy_attention.config'[0]['tau']: expected a finite number > 0", capsys)
    with pytest.raises(ValueError, match=r"\['tau'\]: expected a finite number > 0"):     # a config given in Python: an error
        cq.select_attention(json.loads(f'{{"attention": "comfy_kitchen_sol", "tau": {tau}}}'),
                                       {'comfy_kitchen_sol'}, 'blk')
    rep = cq.validate(str(p), strict=True)
    assert not rep.ok and "'blk.comfy_attention.config'[0]['tau']" in rep.errors[0]

@pytest.mark.parametrize('method', ['3', 'null', '[]', '{}'])
@pytest.mark.writes_invalid
def test_attention_method_type(tmp_path, capsys, method):
    p = attn_file(tmp_path / 'a.safetensors', f'[{{"attention": {method}}}, {{"attention": "comfy_kitchen_int8"}}]')
    assert_all_warn(p, f"Ignoring unsupported attention method {json.loads(method)!r} for blk.comfy_attention: "
                       f"'blk.comfy_attention.config'[0]['attention']: expected a method name string", capsys)
    with pytest.warns(cq.CheckpointWarning):
        assert cq.open_checkpoint(p).modules()['blk'].attention == [{'attention': 'comfy_kitchen_int8'}]   # the rest kept

@pytest.mark.parametrize('cfg', ['5', '"sol"', '[7]'])
@pytest.mark.writes_invalid
def test_attention_not_an_object(tmp_path, capsys, cfg):
    p = attn_file(tmp_path / 'a.safetensors', cfg)
    assert_all_warn(p, "expected an object like", capsys)
    with pytest.warns(cq.CheckpointWarning):
        assert cq.open_checkpoint(p).modules()['blk'].attention is None

def test_attention_valid_tau_selected():
    got = cq.select_attention({'attention': 'comfy_kitchen_sol', 'tau': 0.5}, {'comfy_kitchen_sol'}, 'blk')
    assert got.options == {'tau': 0.5}

# 5. a leading '.' (empty module name)
@pytest.mark.writes_invalid
def test_leading_dot_names(tmp_path, capsys):
    p = module_file(tmp_path / 'a.safetensors', '{"format": "float8_e4m3fn"}', prefix='.')
    assert_all_fail(p, "'.weight': expected a tensor name like '<module>.weight' or 'weight', found a leading '.'",
                    capsys)
    capsys.readouterr(); assert main(['convert', str(p), str(tmp_path / 'out.safetensors')]) == 1
    assert "'.weight': expected a tensor name like" in capsys.readouterr().err
    sd = {'.weight': torch.ones(2, 2)}
    with pytest.raises(ValueError, match="'.weight': expected a tensor name like"):
        cq.save_file(sd, tmp_path / 'b.safetensors')

# 6. non-regular files
def test_fifo_refused(tmp_path, capsys):
    p = tmp_path / 'pipe.safetensors'; os.mkfifo(p)
    assert_all_fail(p, 'expected a regular file, found a FIFO', capsys)
    assert_all_fail(tmp_path, 'expected a checkpoint file, found a directory', capsys)

# 7. _quantization_metadata layer names with a prefix the tensors lack: linear time, one warning
@pytest.mark.writes_invalid
def test_qmeta_prefix_linear(tmp_path, monkeypatch):
    "The suffix index is built once per file, not once per layer (timings: bench/bench_qmeta_open.py; tests never time)."
    n, meta_layers, ents, data = 5_000, {}, [], b''
    c = torch.ones(()).numpy().tobytes()
    for i in range(n):
        ents.append(f'"m{i}.weight": {{"dtype": "F32", "shape": [], "data_offsets": [{4 * i}, {4 * i + 4}]}}')
        meta_layers[f'model.diffusion_model.m{i}'] = {'format': 'float8_e4m3fn'}
    meta_layers['model.nowhere'] = {'format': 'float8_e4m3fn'}
    hdr = '{' + f'"__metadata__": {json.dumps({"_quantization_metadata": json.dumps({"layers": meta_layers})})}, '
    p = raw_file(tmp_path / 'a.safetensors', hdr + ', '.join(ents) + '}', c * n)
    built, by_suffix = [], cq.checkpoint._by_suffix
    monkeypatch.setattr(cq.checkpoint, '_by_suffix', lambda mods: built.append(len(mods)) or by_suffix(mods))
    with pytest.warns(cq.checkpoint.CheckpointWarning) as w:
        ck = cq.open_checkpoint(p, convert=True)
    assert built == [n], built
    assert 'm4999.comfy_quant' in ck and 'm0.comfy_quant' in ck
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "1 _quantization_metadata layer(s) match no '<module>.weight' tensor" in msgs[0]
    assert "'model.nowhere'" in msgs[0]
    ck.close()

# 8. options are checked before shapes when the logical shape is inferred from the file
def saved(tmp_path, sd:dict, name='m.safetensors'):
    p = tmp_path / name; cq.save_file(sd, p, validate=False); return p

def quantized_sd(fmt:str, shape:tuple, **cfg) -> dict:
    torch.manual_seed(0)
    qt = cq.tensor.quantize(torch.randn(*shape, dtype=torch.bfloat16), fmt)
    return {**qt.state_dict('blk.'), 'blk.comfy_quant': cq.tensor.encode_json({**qt.config, **cfg})}

@pytest.mark.parametrize('g', [-16, 0, 2**40])
@pytest.mark.writes_invalid
def test_w4a8_bad_group_size(tmp_path, capsys, g):
    sd = quantized_sd('asym_w4a8_int8', (32, 256), group_size=g)
    msg = f"'blk.comfy_quant['group_size']': expected a group size G >= 4 that divides 16 or is a multiple of 16, " \
          f"dividing K=256 of weight shape (32, 256), found G={g}"
    assert_all_fail(saved(tmp_path, sd), msg, capsys)
    with pytest.raises(ValueError) as e: cq.load_quantized(sd, 'blk')
    assert msg in str(e.value)

@pytest.mark.writes_invalid
def test_w4a8_group_size_mismatch(tmp_path, capsys):
    sd = quantized_sd('asym_w4a8_int8', (32, 256), group_size=32)     # stored with G=16
    msg = ("'blk.weight_s_rel': expected one scale per group of G=32: shape (32, 8) for weight (32, 256), "
           "found shape (32, 16) (the scales of G=16: is comfy_quant['group_size']=32 right?)")
    assert_all_fail(saved(tmp_path, sd), msg, capsys)
    with pytest.raises(ValueError) as e: cq.load_quantized(sd, 'blk')
    assert msg in str(e.value)

@pytest.mark.writes_invalid
def test_nvfp4_1d_storage_names_module(tmp_path, capsys):
    sd = quantized_sd('nvfp4', (32, 64))
    sd['blk.weight'] = sd['blk.weight'].reshape(-1)
    msg = "'blk.weight': expected a non-empty 2-D (out_features, in_features) weight for nvfp4, found shape (1024,)"
    assert_all_fail(saved(tmp_path, sd), msg, capsys)
    with pytest.raises(ValueError) as e: cq.load_quantized(sd, 'blk')
    assert msg in str(e.value)

# 9. bias shape at file level
@pytest.mark.parametrize('bias', [(3,), (1, 2), ()])
@pytest.mark.writes_invalid
def test_linear_bias_shape(tmp_path, capsys, bias):
    sd = quantized_sd('float8_e4m3fn', (2, 16))
    sd['blk.bias'] = torch.zeros(bias)
    assert_all_fail(saved(tmp_path, sd), f"'blk.bias': expected shape [2] (one value per output feature of "
                                         f"float8_e4m3fn weight [2, 16]), found {list(bias)}", capsys)
    sd['blk.bias'] = torch.zeros(2)
    assert cq.load_file(saved(tmp_path, sd, 'ok.safetensors'))['blk.bias'].shape == (2,)

@pytest.mark.writes_invalid
def test_bank_bias_shape(tmp_path, capsys):
    from cquant.modules import QuantMoEExperts
    torch.manual_seed(0)
    sd = QuantMoEExperts(3, 256, 32).quantize_('float8_e4m3fn').state_dict(prefix='moe.up.')
    assert cq.load_file(saved(tmp_path, sd, 'ok.safetensors'))['moe.up.bias'].shape == (3, 32)
    sd['moe.up.bias'] = torch.zeros(4, 32)
    assert_all_fail(saved(tmp_path, sd), "'moe.up.bias': expected shape [3, 32] (one value per output feature of "
                                         "float8_e4m3fn weight [3, 32, 256]), found [4, 32]", capsys)

@pytest.mark.writes_invalid
def test_conv_and_padded_bias(tmp_path):
    "A 4-D fp8 weight's bias is [out_channels]; a padded nvfp4 weight accepts the bias of its unpadded rows."
    sd = quantized_sd('float8_e4m3fn', (4, 2, 3, 3))
    sd['blk.bias'] = torch.zeros(4)
    assert cq.load_file(saved(tmp_path, sd))['blk.bias'].shape == (4,)
    sd = quantized_sd('nvfp4', (60, 128))                          # stored as 64 rows
    sd['blk.bias'] = torch.zeros(60)
    assert cq.load_file(saved(tmp_path, sd, 'b.safetensors'))['blk.bias'].shape == (60,)
    sd['blk.bias'] = torch.zeros(65)
    with pytest.raises(ValueError, match=r"'blk.bias': expected shape \[64\].*found \[65\]"):
        cq.load_file(saved(tmp_path, sd, 'c.safetensors'))

# 10. a stray scale (no comfy_quant) is refused by quantize exactly as load_file refuses it, before DST exists
@pytest.mark.writes_invalid
def test_quantize_refuses_stray_scale(tmp_path, capsys):
    from cquant.cli import main
    sd = {'a.weight': torch.randn(32, 64, dtype=torch.bfloat16), 'a.weight_scale': torch.tensor(1.0),
          'b.weight': torch.randn(32, 64, dtype=torch.bfloat16)}
    src, dst = saved(tmp_path, sd), tmp_path / 'out.safetensors'
    msg = (f"{src}: 'a.weight_scale': expected no scale tensors on module 'a' without a comfy_quant entry, "
           "found ['a.weight_scale'] (a stray scale: add a.comfy_quant or remove it)")
    with pytest.raises(ValueError) as e: cq.load_file(src)
    assert msg in str(e.value)
    with pytest.raises(ValueError) as e: cq.quantize_checkpoint(src, dst, progress=False)
    assert msg in str(e.value)
    assert main(['quantize', str(src), str(dst), '--quiet']) != 0
    assert msg in capsys.readouterr().err
    assert not dst.exists() and list(tmp_path.iterdir()) == [src]

# 6. every defect at once: inspect shows the rest and lists each bad module; convert names them all
@pytest.mark.writes_invalid
def test_five_defects_listed_at_once(tmp_path, capsys):
    sd = {}
    for i in range(6):
        q = cq.quantize(torch.randn(16, 32, generator=torch.Generator().manual_seed(i)), 'float8_e4m3fn')
        sd.update(q.state_dict(f'b{i}.')); sd[f'b{i}.comfy_quant'] = cq.encode_json(q.config)
    defects = {'b0': ('b0.weight_scale', torch.tensor(float('nan')), 'found nan'),
               'b1': ('b1.weight_scale', torch.tensor(-1.0), 'found -1.0'),
               'b2': ('b2.comfy_quant', cq.encode_json({'format': 'int3'}), "found 'int3'"),
               'b3': ('b3.weight_scale', torch.ones(3), 'found shape (3,)'),
               'b4': ('b4.weight', torch.zeros(16, 32, dtype=torch.bfloat16), 'found torch.bfloat16')}
    for k, v, _ in defects.values(): sd[k] = v
    p = tmp_path / 'five.safetensors'
    safetensors.torch.save_file(sd, str(p))
    capsys.readouterr()
    assert main(['inspect', str(p)]) == 1
    out, err = capsys.readouterr()
    assert '\nb5 ' in out and '5 module(s) not shown' in out                      # the good module is shown
    lines = [l for l in err.splitlines() if l.startswith('cquant inspect: error:')]
    assert len(lines) == 5 and all(f"'{k}" in l and found in l for l, (k, _, found) in zip(lines, defects.values())), err
    assert sorted(cq.inspect_checkpoint(p, collect=True)['errors']) == sorted(defects)
    with pytest.raises(ValueError, match='found nan'): cq.inspect_checkpoint(p)   # the library call raises by default
    assert main(['convert', str(p), str(tmp_path / 'out.safetensors')]) == 1
    err = capsys.readouterr().err
    assert '5 module(s) cannot be converted' in err and all(f"  {m}: " in err for m in defects), err
    assert not (tmp_path / 'out.safetensors').exists()

# 7. a _quantization_metadata layer that matches no tensor: the CLI says so
@pytest.mark.parametrize('cmd', ['inspect', 'convert'])
def test_unmatched_legacy_layer_shown_by_cli(tmp_path, capsys, cmd):
    meta = {'_quantization_metadata': json.dumps({'layers': {'blk': {'format': 'float8_e4m3fn'}, 'ghost': {'format': 'float8_e4m3fn'}}})}
    p = tmp_path / 'ghost.safetensors'
    safetensors.torch.save_file({'blk.weight': torch.randn(16, 32).to(torch.float8_e4m3fn), 'blk.weight_scale': torch.tensor(0.5)},
                                str(p), metadata=meta)
    capsys.readouterr()
    assert main([cmd, str(p)] + ([str(tmp_path / 'out.safetensors')] if cmd == 'convert' else [])) == 0
    assert "warning: " in (err := capsys.readouterr().err) and "match no '<module>.weight' tensor, skipped: ['ghost']" in err, err
