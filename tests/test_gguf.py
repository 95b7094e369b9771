"""GGUF sources through every entry point (issue 40): a file `gguf`'s writer makes from MiniLM's real weights, as
ComfyUI-GGUF's converter lays one out, read bit-exactly as `gguf` decodes it, quantized by the CLI, and refused
clearly when damaged. The decoders themselves are checked against `gguf` in nbs/10b_gguf."""
import json, math, os, struct
from pathlib import Path
import numpy as np, pytest, torch, gguf
import cquant as cq
from cquant.modules import requantize_options
from cquant.minilm import minilm_model, minilm_path
from conftest import cquant_cli

T = gguf.GGMLQuantizationType
LINEAR_TYPES = ('Q8_0', 'Q5_1', 'Q4_0', 'Q5_0', 'Q4_1')      # the types gguf encodes, one per encoder layer and more


def _type_of(k:str, a:np.ndarray) -> str:
    "What ComfyUI-GGUF's converter keeps: 1-D and tiny tensors in F32, the rest in the file's type (here a mix)."
    if a.ndim == 1 or a.size <= 1024: return 'F32'
    if 'embeddings' in k: return 'F16'
    layer = int(k.split('.')[2]) if k.startswith('encoder.layer.') else 0
    return LINEAR_TYPES[layer % len(LINEAR_TYPES)]


@pytest.fixture(scope='module')
def minilm_gguf(tmp_path_factory):
    "(path, {name: (ggml type, float source)}) of MiniLM's weights in a GGUF file."
    from safetensors.torch import load_file
    path = tmp_path_factory.mktemp('gguf') / 'minilm-mixed.gguf'
    sd = {k: v for k, v in load_file(minilm_path()).items() if v.is_floating_point()}
    wr = gguf.GGUFWriter(str(path), arch='bert')
    wr.add_quantization_version(gguf.GGML_QUANT_VERSION)
    kinds = {}
    for k, v in sd.items():
        a = v.float().numpy()
        kinds[k] = _type_of(k, a)
        wr.add_tensor(k, gguf.quants.quantize(a, T[kinds[k]]), raw_dtype=T[kinds[k]])
    wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()
    return str(path), kinds


def test_reads_as_gguf_decodes(minilm_gguf):
    "Every tensor of `open_checkpoint` and `load_file` has the bits of `gguf.quants.dequantize` of its stored data."
    path, kinds = minilm_gguf
    r = gguf.GGUFReader(path)
    sd = cq.load_file(path)
    with cq.open_checkpoint(path) as ck:
        assert set(ck) == set(sd) == set(kinds) == {t.name for t in r.tensors}
        for t in r.tensors:
            want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            got = sd[t.name]
            assert got.dtype == (torch.float16 if kinds[t.name] == 'F16' else torch.float32), t.name
            assert tuple(got.shape) == tuple(reversed([int(d) for d in t.shape])), t.name
            assert torch.equal(got.float().view(torch.int32), want.float().view(torch.int32)), t.name
            assert ck.info(t.name).stored_as == kinds[t.name] and ck.info(t.name).stored_nbytes == t.n_bytes
    assert ck.metadata['general.architecture'] == 'bert'


def test_inspect_shows_the_gguf_types(minilm_gguf):
    path, kinds = minilm_gguf
    rc, out, err = cquant_cli('inspect', path)
    assert rc == 0, err
    info = json.loads(cquant_cli('inspect', path, '--json')[1])
    assert info['gguf_types'] == {k: list(kinds.values()).count(k) for k in set(kinds.values())}
    counts = ', '.join(f"{k} {n}" for k, n in info['gguf_types'].items())
    assert f"(GGUF: {counts}; quantized types read decoded to fp32)" in out.splitlines()[0]
    row = next(l for l in out.splitlines() if l.startswith('encoder.layer.1.attention.self.query '))
    assert 'Q5_1[384, 384]' in row and '(384, 384)' in row and '108.00 KiB' in row      # 6 bits a weight: 384·384·6/8 bytes
    assert info['tensor_bytes'] == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)


def test_quantize_a_gguf_file(minilm_gguf, tmp_path):
    """`cquant quantize model.gguf out.safetensors --mode int8`: the report says the source was lossy, the output
    loads in the module layer, and each layer's SQNR against the decoded GGUF weight is the one the report states."""
    path, kinds = minilm_gguf
    out, rep = tmp_path / 'minilm-int8.safetensors', tmp_path / 'r.json'
    rc, text, err = cquant_cli('quantize', path, out, '--mode', 'int8', '--report', rep)
    assert rc == 0, err
    assert 'source: GGUF (' in text and 'already lossy: each SQNR is against the decoded GGUF weights' in text, text
    report = json.loads(rep.read_text())
    assert report['totals']['gguf_source'] == {k: list(kinds.values()).count(k) for k in set(kinds.values())}
    assert report['totals']['bytes_before'] == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)
    src = cq.load_file(path)
    model = cq.load_quantized_model(minilm_model(), cq.load_file(out), strict=False)
    layers = {r['name']: r for r in report['layers'] if r['format']}
    assert len(layers) >= 36
    for name, r in layers.items():
        if name.startswith('pooler.'): continue           # MiniLM's encoder has no pooler
        w = model.get_submodule(name).weight.dequantize(torch.float32)
        ref = src[name + '.weight'].float()
        sqnr = 10 * math.log10(ref.pow(2).sum() / (ref - w).pow(2).sum())
        assert abs(sqnr - r['sqnr_db']) < 1e-3, (name, sqnr, r['sqnr_db'])
    # decoded, then quantized: the bits `cq.quantize` gives the decoded GGUF weight in the same format
    for name in ('encoder.layer.0.attention.self.query', 'encoder.layer.1.output.dense'):
        qt = model.get_submodule(name).weight
        want = cq.quantize(src[name + '.weight'].float(), layers[name]['format'], **requantize_options(qt))
        assert torch.equal(qt.dequantize(torch.float32), want.dequantize(torch.float32)), name


@pytest.mark.writes_invalid
def test_damaged_gguf_everywhere(minilm_gguf, tmp_path):
    "A damaged GGUF file gets a clear error naming it from each entry point, and nothing is written."
    raw = Path(minilm_gguf[0]).read_bytes()
    n = struct.unpack('<Q', raw[8:16])[0]
    cases = {'magic': (b'GGUX' + raw[4:], "expected a GGUF file (starting with b'GGUF'), found b'GGUX'"),
             'truncated': (raw[:len(raw) // 2], 'a truncated file, or a wrong count or offset in its header?'),
             'count': (raw[:8] + struct.pack('<Q', n - 1) + raw[16:], '(wrong tensor count?)')}
    for case, (data, msg) in cases.items():
        bad = tmp_path / f'{case}.gguf'
        bad.write_bytes(data)
        with pytest.raises(cq.CheckpointError) as e: cq.load_file(bad)
        assert str(e.value).startswith(str(bad)) and msg in str(e.value), (case, str(e.value))
        for argv in (('inspect', bad), ('plan', bad), ('quantize', bad, tmp_path / 'out.safetensors', '--mode', 'int8')):
            rc, out, err = cquant_cli(*argv)
            assert rc != 0 and msg in err and 'Traceback' not in err, (case, argv, err)
    assert sorted(os.listdir(tmp_path)) == sorted(f'{c}.gguf' for c in cases)
