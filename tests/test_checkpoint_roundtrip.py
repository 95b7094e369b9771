"""Round trips through cquant's checkpoint layer.

- cquant-written file -> load -> save: identical tensors, dtypes and decoded configs; repeated saves (from a
  dict and streamed from a lazy Checkpoint) are byte-identical; safetensors reads the files.
- legacy files (scaled_fp8 with e4m3 / e5m2 / 2-element markers, `_quantization_metadata` with and without a
  model prefix) convert on load; saved, they are modern files with identical dequantized weights.
- files written from comfy-kitchen layouts (kitchen state dicts + a ComfyUI-style comfy_quant made with
  json.dumps) load in cquant and dequantize to kitchen's exact bits; and kitchen, given the entries of a
  cquant-written file, dequantizes them to cquant's bits.
- an interrupted save leaves the previous file untouched.
"""
import json, os, stat

import pytest
import torch
from safetensors.torch import load_file as st_load, save_file as st_save

import cquant as cq
from cquant.checkpoint import (Checkpoint, CheckpointError, decode_json, encode_json, inspect_checkpoint, load_file,
                               open_checkpoint, save_file)
from cquant.tensor import same_bits, test_bits as check_bits

# (format, quantize options, logical shape): shapes obey each format's rules; odd ones exercise padding
CASES = [('float8_e4m3fn', {}, (33, 50)), ('float8_e5m2', {}, (16, 32)), ('nvfp4', {}, (60, 120)),
         ('mxfp8', {}, (60, 120)), ('int8_tensorwise', {}, (16, 48)), ('int8_tensorwise', {'per_row': True}, (16, 48)),
         ('int8_tensorwise', {'convrot': True}, (32, 256)), ('convrot_w4a4', {}, (32, 256)),
         ('asym_w4a8_int8', {}, (32, 256)), ('w6a8_int8', {}, (32, 256))]
HAVE = [c for c in CASES if c[0] in cq.FORMATS]


def ck_json(conf):
    "comfy_quant the way ComfyUI writes it."
    return torch.tensor(list(json.dumps(conf).encode('utf-8')), dtype=torch.uint8)


def need(*fmts):
    missing = [f for f in fmts if f not in cq.FORMATS]
    if missing: pytest.skip(f'formats not registered yet: {missing}')


def _model():
    "A state dict with every registered format, biases, float layers, an input scale and attention preferences."
    g = torch.Generator().manual_seed(0)
    sd, shapes, qts = {}, {}, {}
    for i, (fmt, opts, shape) in enumerate(HAVE):
        m = f'blocks.{i}.lin'
        qt = cq.quantize(torch.randn(shape, generator=g).to(torch.bfloat16), fmt, **opts)
        sd[m + '.weight'] = qt; sd[m + '.bias'] = torch.randn(shape[0], generator=g).to(torch.bfloat16)
        shapes[m], qts[m] = shape, qt
        if 'input_scale' in cq.FORMATS[fmt].storage.extra_keys: sd[m + '.input_scale'] = torch.tensor(0.125)
    sd['blocks.0.norm.weight'] = torch.randn(64, generator=g)
    sd['embed.weight'] = torch.randn(10, 8, generator=g).to(torch.float16)
    sd['blocks.0.attn.comfy_attention.config'] = encode_json([{'attention': 'comfy_kitchen_sol', 'tau': 1.25}, {'attention': 'future_method', 'x': [1, 2]}, {'attention': 'comfy_kitchen_int8'}])
    return sd, shapes, qts


def test_cquant_roundtrip(tmp_path):
    if not HAVE: pytest.skip('no formats registered yet')
    sd, shapes, qts = _model()
    a, b, c = (tmp_path / f'{n}.safetensors' for n in 'abc')
    save_file(sd, a, {'producer': 'cquant test', 'z': '1'})
    got, meta = load_file(a, with_metadata=True)
    assert meta == {'producer': 'cquant test', 'z': '1'}
    ref = Checkpoint.from_state_dict(sd).state_dict()
    assert sorted(got) == sorted(ref)
    for k in ref: check_bits(got[k], ref[k], k)
    for m, qt in qts.items():
        assert decode_json(got[m + '.comfy_quant']) == qt.config
    assert decode_json(got['blocks.0.attn.comfy_attention.config'])[1] == {'attention': 'future_method', 'x': [1, 2]}
    # load -> save: byte-identical, from a dict and streamed from the lazy checkpoint
    save_file(got, b, meta)
    assert a.read_bytes() == b.read_bytes()
    with open_checkpoint(b) as ck: save_file(ck, c)
    assert a.read_bytes() == c.read_bytes()
    # the logical tensors are the ones we quantized
    ck = open_checkpoint(a)
    for m, qt in qts.items():
        check_bits(ck.quantized(m, shapes[m], torch.bfloat16).dequantize(), qt.dequantize(), m)
    # what safetensors itself reads
    for k, v in st_load(a).items(): check_bits(v, got[k], k)


def test_config_bytes_and_extra_keys_preserved(tmp_path):
    need('int8_tensorwise')
    qt = cq.quantize(torch.randn(16, 256), 'int8_tensorwise', convrot=True)
    cfg = ck_json({'format': 'int8_tensorwise', 'full_precision_matrix_mult': True, 'params': {'convrot': True, 'convrot_groupsize': 256}})
    sd = {**qt.state_dict('l.'), 'l.comfy_quant': cfg}
    save_file(sd, tmp_path / 'x.safetensors')
    ck = open_checkpoint(tmp_path / 'x.safetensors')
    check_bits(ck['l.comfy_quant'], cfg)                 # the JSON bytes are kept as written
    e = ck.modules()['l']
    assert e.options['convrot'] is True and e.options['convrot_groupsize'] == 256   # nested params resolved
    assert inspect_checkpoint(ck)['modules'][0]['options']['full_precision_matrix_mult'] is True
    # a QuantizedTensor with an explicit comfy_quant keeps the explicit one
    save_file({'l.weight': qt, 'l.comfy_quant': cfg}, tmp_path / 'y.safetensors')
    assert (tmp_path / 'x.safetensors').read_bytes() == (tmp_path / 'y.safetensors').read_bytes()
    with pytest.raises(CheckpointError, match="expected a config of format 'int8_tensorwise'"):
        save_file({'l.weight': qt, 'l.comfy_quant': ck_json({'format': 'nvfp4'})}, tmp_path / 'z.safetensors')


# ---------------------------------------------------------------- legacy
def _fp8(shape, dt, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dt)


def test_legacy_scaled_fp8(tmp_path):
    need('float8_e4m3fn', 'float8_e5m2')
    D, T = 'model.diffusion_model.', 'text_encoders.t5xxl.transformer.'
    legacy = {D + 'scaled_fp8': torch.empty(0, dtype=torch.float8_e4m3fn),
              D + 'a.weight': _fp8((16, 32), torch.float8_e4m3fn, 0), D + 'a.scale_weight': torch.tensor(0.03),
              D + 'a.scale_input': torch.tensor(1.0), D + 'a.bias': torch.randn(16),
              D + 'b.weight': _fp8((8, 32), torch.float8_e4m3fn, 1), D + 'b.scale_weight': torch.tensor([0.5]),
              D + 'b.scale_input': torch.tensor(0.25),
              D + 'norm.weight': torch.ones(32),
              T + 'scaled_fp8': torch.empty(2, dtype=torch.float8_e5m2),
              T + 'q.weight': _fp8((8, 16), torch.float8_e5m2, 2), T + 'q.scale_weight': torch.tensor(4.0),
              'vae.conv.weight': torch.randn(4, 4, 3, 3)}
    src, out = tmp_path / 'legacy.safetensors', tmp_path / 'modern.safetensors'
    st_save(legacy, src)
    ck = open_checkpoint(src)
    assert ck.legacy == 'scaled_fp8'
    assert decode_json(ck[D + 'a.comfy_quant']) == {'format': 'float8_e4m3fn'}
    assert decode_json(ck[T + 'q.comfy_quant']) == {'format': 'float8_e5m2', 'full_precision_matrix_mult': True}
    assert D + 'a.input_scale' not in ck and float(ck[D + 'b.input_scale']) == 0.25
    save_file(ck, out)
    modern = st_load(out)                   # a plain safetensors reader sees modern keys only
    assert not any(k.endswith(('scaled_fp8', '.scale_weight', '.scale_input')) for k in modern)
    assert modern[T + 'q.weight'].dtype == torch.float8_e5m2      # not cast to e4m3 (ComfyUI would)
    mck = open_checkpoint(out)
    assert mck.legacy is None
    for m in (D + 'a', D + 'b', T + 'q'):
        want = legacy[m + '.weight'].float() * legacy[m + '.scale_weight'].float().reshape(())
        check_bits(mck.quantized(m, dtype=torch.float32).dequantize(), want, m)
    for k in (D + 'a.bias', D + 'norm.weight', 'vae.conv.weight'): check_bits(modern[k], legacy[k], k)
    # saving the converted file again changes nothing
    save_file(load_file(out), tmp_path / 'again.safetensors')
    assert out.read_bytes() == (tmp_path / 'again.safetensors').read_bytes()


@pytest.mark.parametrize('names', ['bare', 'prefixed', 'header_prefixed'])
def test_legacy_quantization_metadata(tmp_path, names):
    need('nvfp4', 'float8_e4m3fn')
    P = 'model.diffusion_model.'
    g = torch.Generator().manual_seed(3)
    q1 = cq.quantize(torch.randn(60, 120, generator=g), 'nvfp4')
    q2 = cq.quantize(torch.randn(16, 32, generator=g), 'float8_e4m3fn')
    tp = P if names == 'prefixed' else ''                   # prefix on the tensors
    hp = P if names == 'header_prefixed' else ''             # prefix on the header's layer names
    sd = {**q1.state_dict(tp + 'x.'), **q2.state_dict(tp + 'y.'), tp + 'z.weight': torch.randn(4, 4)}
    layers = {hp + 'x': {'format': 'nvfp4'}, hp + 'y': {'format': 'float8_e4m3fn'}}
    src = tmp_path / 'qm.safetensors'
    st_save(sd, src, metadata={'_quantization_metadata': json.dumps({'format_version': '1.0', 'layers': layers}), 'keep': 'me'})
    got, meta = load_file(src, with_metadata=True)
    assert meta == {'keep': 'me'}
    assert decode_json(got[tp + 'x.comfy_quant']) == {'format': 'nvfp4'}
    out = tmp_path / 'modern.safetensors'
    save_file(got, out, meta)
    ck = open_checkpoint(out)
    assert ck.legacy is None and ck.metadata == {'keep': 'me'}
    check_bits(ck.quantized(tp + 'x', (60, 120), torch.float32).dequantize(), q1.dequantize(torch.float32))
    check_bits(ck.quantized(tp + 'y', dtype=torch.float32).dequantize(), q2.dequantize(torch.float32))


# ---------------------------------------------------------------- comfy-kitchen files
ck_tensor = pytest.importorskip('comfy_kitchen.tensor')
KQT = ck_tensor.QuantizedTensor
KITCHEN = [  # id, cquant format, kitchen layout, kitchen quantize kwargs, comfy_quant, shape
    ('fp8_e4m3', 'float8_e4m3fn', 'TensorCoreFP8Layout', {}, {'format': 'float8_e4m3fn'}, (33, 50)),
    ('fp8_e5m2', 'float8_e5m2', 'TensorCoreFP8Layout', {'dtype': torch.float8_e5m2}, {'format': 'float8_e5m2'}, (16, 40)),
    ('nvfp4', 'nvfp4', 'TensorCoreNVFP4Layout', {}, {'format': 'nvfp4'}, (60, 120)),
    ('mxfp8', 'mxfp8', 'TensorCoreMXFP8Layout', {}, {'format': 'mxfp8'}, (60, 120)),
    ('int8', 'int8_tensorwise', 'TensorWiseINT8Layout', {}, {'format': 'int8_tensorwise'}, (16, 48)),
    ('int8_row', 'int8_tensorwise', 'TensorWiseINT8Layout', {'per_channel': True}, {'format': 'int8_tensorwise'}, (16, 48)),
    ('int8_convrot', 'int8_tensorwise', 'TensorWiseINT8Layout', {'per_channel': True, 'convrot': True, 'convrot_groupsize': 64},
     {'format': 'int8_tensorwise', 'convrot': True, 'convrot_groupsize': 64}, (32, 128)),
    ('int8_convrot_params', 'int8_tensorwise', 'TensorWiseINT8Layout', {'per_channel': True, 'convrot': True},
     {'format': 'int8_tensorwise', 'params': {'convrot': True, 'convrot_groupsize': 256}}, (32, 256)),
]


@pytest.mark.parametrize('case', KITCHEN, ids=[c[0] for c in KITCHEN])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_kitchen_files_load_identically(tmp_path, case, dtype):
    _, fmt, layout, kw, conf, shape = case
    need(fmt)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    kq = KQT.from_float(w, layout, **kw)
    sd = {**kq.state_dict('blk.lin.weight'), 'blk.lin.comfy_quant': ck_json(conf), 'blk.lin.bias': torch.zeros(shape[0], dtype=dtype)}
    p = tmp_path / 'kitchen.safetensors'
    st_save({k: v.contiguous() for k, v in sd.items()}, p)
    ck = open_checkpoint(p)
    qt = ck.quantized('blk.lin', shape, dtype)
    assert qt.format == fmt and tuple(qt.shape) == shape
    check_bits(qt.dequantize(), kq.dequantize(), fmt)
    # raw uint8 scale bytes (older writers) are reinterpreted, not cast
    u8 = {k: (v.view(torch.uint8) if k.endswith('weight_scale') and v.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else v) for k, v in sd.items()}
    if any(v.dtype == torch.uint8 for k, v in u8.items() if k.endswith('weight_scale')):
        st_save({k: v.contiguous() for k, v in u8.items()}, tmp_path / 'u8.safetensors')
        check_bits(open_checkpoint(tmp_path / 'u8.safetensors').quantized('blk.lin', shape, dtype).dequantize(), kq.dequantize(), fmt + ' u8 scales')
    # cquant re-saves it and the bytes of every entry survive
    save_file(ck, tmp_path / 'resaved.safetensors')
    again = st_load(tmp_path / 'resaved.safetensors')
    for k, v in sd.items(): check_bits(again[k], v.contiguous(), k)


def _kitchen_from_cquant_file(sd, m, fmt, shape, dtype):
    "What ComfyUI does with a cquant file: kitchen Params from the entries (scales viewed, never cast)."
    L = ck_tensor
    conf = decode_json(sd[m + 'comfy_quant'])
    w, s = sd[m + 'weight'], sd[m + 'weight_scale']
    if fmt.startswith('float8'):
        return KQT(w, 'TensorCoreFP8Layout', L.TensorCoreFP8Layout.Params(scale=s, orig_dtype=dtype, orig_shape=shape))
    if fmt == 'nvfp4':
        return KQT(w, 'TensorCoreNVFP4Layout', L.TensorCoreNVFP4Layout.Params(scale=sd[m + 'weight_scale_2'], orig_dtype=dtype, orig_shape=shape, block_scale=s.view(torch.float8_e4m3fn)))
    if fmt == 'mxfp8':
        return KQT(w, 'TensorCoreMXFP8Layout', L.TensorCoreMXFP8Layout.Params(scale=s.view(torch.float8_e8m0fnu), orig_dtype=dtype, orig_shape=shape))
    if fmt == 'int8_tensorwise':
        return KQT(w, 'TensorWiseINT8Layout', L.TensorWiseINT8Layout.Params(scale=s, orig_dtype=dtype, orig_shape=shape,
                   convrot=bool(conf.get('convrot', False)), convrot_groupsize=int(conf.get('convrot_groupsize', 256))))
    return None


@pytest.mark.parametrize('case', [c for c in CASES if c[0] in ('float8_e4m3fn', 'float8_e5m2', 'nvfp4', 'mxfp8', 'int8_tensorwise')],
                         ids=lambda c: c[0] + ''.join(f'-{k}' for k in c[1]))
def test_cquant_files_dequantize_identically_in_kitchen(tmp_path, case):
    fmt, opts, shape = case
    need(fmt)
    qt = cq.quantize(torch.randn(shape, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16), fmt, **opts)
    save_file({'m.weight': qt}, tmp_path / 'c.safetensors')
    sd = st_load(tmp_path / 'c.safetensors')
    kq = _kitchen_from_cquant_file(sd, 'm.', fmt, shape, torch.bfloat16)
    check_bits(kq.dequantize(), qt.dequantize(), fmt)


# ---------------------------------------------------------------- atomic save
def test_interrupted_save_keeps_old_file(tmp_path, monkeypatch):
    import cquant.checkpoint as cqc
    p = tmp_path / 'model.safetensors'
    sd = {'a.weight': torch.randn(64, 64), 'b.weight': torch.randn(32, 32), 'c.weight': torch.randn(16, 16)}
    save_file(sd, p)
    os.chmod(p, 0o640)
    before = p.read_bytes()
    calls = []
    real = cqc._write_tensor
    def boom(f, t, i, path):
        calls.append(i.name)
        if len(calls) == 2:
            f.write(b'partial garbage'); f.flush()
            raise KeyboardInterrupt('power cut (injected)')
        real(f, t, i, path)
    monkeypatch.setattr(cqc, '_write_tensor', boom)
    with pytest.raises(KeyboardInterrupt):
        save_file({k: v * 2 for k, v in sd.items()}, p)
    assert p.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ['model.safetensors']     # no temp file left
    monkeypatch.setattr(cqc, '_write_tensor', real)
    # a failing fsync is a failed save as well
    def no_fsync(fd): raise OSError('EIO (injected)')
    monkeypatch.setattr(cqc.os, 'fsync', no_fsync)
    with pytest.raises(OSError, match='EIO'):
        save_file({k: v * 2 for k, v in sd.items()}, p)
    monkeypatch.undo()
    assert p.read_bytes() == before and len(list(tmp_path.iterdir())) == 1
    # a successful save replaces it and keeps its permissions
    save_file({k: v * 2 for k, v in sd.items()}, p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    check_bits(load_file(p)['b.weight'], sd['b.weight'] * 2)


def test_save_refuses_bad_input(tmp_path):
    p = tmp_path / 'x.safetensors'
    with pytest.raises(CheckpointError, match="'a': expected a torch.Tensor, found list"):
        save_file({'a': [1, 2]}, p)
    with pytest.raises(CheckpointError, match="expected no scale tensors on module 'l' without a comfy_quant"):
        save_file({'l.weight': torch.zeros(2, 2), 'l.weight_scale': torch.tensor(1.0)}, p)
    with pytest.raises(CheckpointError, match='metadata'):
        save_file({'a': torch.zeros(1)}, p, {'k': 1})
    assert not p.exists()


def test_save_through_symlink_and_onto_source(tmp_path):
    real, link = tmp_path / 'real.safetensors', tmp_path / 'link.safetensors'
    save_file({'a.weight': torch.ones(4)}, real)
    link.symlink_to(real)
    save_file({'a.weight': torch.zeros(4)}, link)
    assert link.is_symlink() and float(load_file(real)['a.weight'].sum()) == 0
    # streaming a file onto itself: the reader keeps the old inode until the replace
    with open_checkpoint(real) as ck: save_file(ck, real, {'rewritten': 'yes'})
    assert load_file(real, with_metadata=True)[1] == {'rewritten': 'yes'}


# ------------------------------------------------------------------------------------------------ MoE expert banks
BANKS = [('float8_e4m3fn', {}), ('float8_e4m3fn', {'shared_scale': True}), ('int8_tensorwise', {}),
         ('int8_tensorwise', {'per_row': True}), ('nvfp4', {}), ('mxfp8', {}), ('convrot_w4a4', {}),
         ('asym_w4a8_int8', {}), ('w6a8_int8', {})]


def _bank(fmt, opts, E=3, K=256, N=32):
    from cquant.modules import QuantMoEExperts
    need(fmt)
    torch.manual_seed(0)
    return QuantMoEExperts(E, K, N).quantize_(fmt, **opts)


@pytest.mark.parametrize('fmt,opts', BANKS, ids=[f + ''.join(f'-{k}' for k in o) for f, o in BANKS])
def test_bank_checkpoint_validated(tmp_path, fmt, opts):
    "Every bank format saves and loads with validation; each expert is checked, the bank's shape is (E, N, K)."
    E, K, N = 3, 256, 32
    bank = _bank(fmt, opts, E, K, N)
    sd = bank.state_dict(prefix='moe.up.')
    p = str(tmp_path / 'bank.safetensors')
    save_file(sd, p)                                          # validated
    loaded = load_file(p)                                     # validated
    assert sorted(loaded) == sorted(sd)
    for k, v in sd.items(): check_bits(loaded[k], v, k)
    with open_checkpoint(p) as ck:
        e = ck.modules()['moe.up']
        assert (e.format, e.num_experts, e.shape) == (fmt, E, (E, N, K))
        assert ck.modules({'moe.up': (E, N, K)})['moe.up'].shape == (E, N, K)    # the model's bank shape
        assert ck.modules({'moe.up': (N, K)})['moe.up'].shape == (E, N, K)       # or one expert's
        with pytest.raises(CheckpointError, match=r"'moe\.up\.weight': expected one quantized weight, found an MoE bank of 3 experts"):
            ck.quantized('moe.up')
    from cquant.modules import QuantMoEExperts
    b2 = QuantMoEExperts(E, K, N)
    assert str(b2.load_state_dict({k[len('moe.up.'):]: v for k, v in loaded.items()})) == '<All keys matched successfully>'
    x, ids = torch.randn(12, K), torch.arange(12) % E
    check_bits(b2(x, ids), bank(x, ids), 'bank from a validated file')


@pytest.mark.parametrize('fmt,opts', [('nvfp4', {}), ('float8_e4m3fn', {}), ('asym_w4a8_int8', {})])
@pytest.mark.writes_invalid
def test_bank_checkpoint_rejects_bad_banks(tmp_path, fmt, opts):
    "A wrong num_experts, an input_scale or pre_quant_scale on a bank: refused, naming the file, module and key."
    E, K, N = 3, 256, 32
    sd = _bank(fmt, opts, E, K, N).state_dict(prefix='moe.up.')
    cfg = decode_json(sd['moe.up.comfy_quant'])
    p = str(tmp_path / 'bad.safetensors')
    bad_e = {**sd, 'moe.up.comfy_quant': encode_json({**cfg, 'num_experts': 5})}   # 5 divides neither E nor E*N rows
    with pytest.raises(CheckpointError, match=r"'moe\.up\.weight': expected a (bank with leading expert dim 5|flattened bank of 5 experts).*module 'moe\.up'.*num_experts=5"):
        save_file(bad_e, p)
    st_save(bad_e, p)                                         # written without cquant's checks: the loader refuses it
    with pytest.raises(CheckpointError, match=rf"^{p}: 'moe\.up\.weight'.*num_experts=5"):
        load_file(p)
    for key, t in (('input_scale', torch.tensor(1.0)), ('pre_quant_scale', torch.ones(K))):
        bad = {**sd, f'moe.up.{key}': t}
        with pytest.raises(CheckpointError, match=rf"'moe\.up\.{key}': expected no input_scale or pre_quant_scale on MoE expert bank 'moe\.up'"):
            save_file(bad, p)
        st_save(bad, p)
        with pytest.raises(CheckpointError, match=rf"^{p}: 'moe\.up\.{key}'"):
            load_file(p)
    for n in (0, -1, True, 2.5, '3'):
        with pytest.raises(CheckpointError, match=r"'moe\.up\.comfy_quant\[\"num_experts\"\]': expected a positive integer \(module 'moe\.up'\)"):
            save_file({**sd, 'moe.up.comfy_quant': encode_json({**cfg, 'num_experts': n})}, p)
    with Checkpoint.from_state_dict(sd) as ck:
        with pytest.raises(CheckpointError, match=r"'moe\.up\.comfy_quant\[\"num_experts\"\]': expected 4 \(module 'moe\.up' is a bank of shape \[4, 32, 256\]\), found 3"):
            ck.modules({'moe.up': (4, N, K)})
