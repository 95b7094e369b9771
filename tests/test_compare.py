"""`cquant compare` (issue 40): every format and GGUF type on the same weights, through the command a user runs."""
import json, math
import torch, pytest
import cquant as cq
from cquant.compare import candidates, compare_weights
from cquant.gguf import decode_gguf, encode_gguf
from conftest import cquant_cli


@pytest.fixture(scope='module')
def bf16_file(tmp_path_factory):
    "Two MiniLM-shaped linears and a norm in bf16 (real weights where MiniLM is installed)."
    from safetensors.torch import load_file
    from cquant.minilm import minilm_path
    sd = load_file(minilm_path())
    keep = ('encoder.layer.0.attention.self.query.weight', 'encoder.layer.0.intermediate.dense.weight', 'embeddings.LayerNorm.weight')
    path = tmp_path_factory.mktemp('cmp') / 'two.safetensors'
    cq.save_file({k: sd[k].bfloat16().contiguous() for k in keep}, path)
    return path, {k[:-len('.weight')]: sd[k].bfloat16() for k in keep[:2]}


def test_compare_cli_json_matches_the_weights(bf16_file, tmp_path):
    "The JSON's numbers are each candidate's own: bits from the stored bytes, SQNR from the decoded weight."
    path, ws = bf16_file
    rc, out, err = cquant_cli('compare', path, '--formats', 'Q4_K', 'INT8', '--roundings', 'nearest', 'exact',
                              '--json', '--plot', tmp_path / 'c.png')
    assert rc == 0, err
    d = json.loads(out)
    assert [c['label'] for c in d['candidates']] == ['INT8', 'INT8 (exact)', 'GGUF Q4_K']
    assert (tmp_path / 'c.png').stat().st_size > 10_000
    w = ws['encoder.layer.0.intermediate.dense']                 # 1536 x 384: rows of 384, stored as rows of 256
    dq = decode_gguf(encode_gguf(w.reshape(-1, 256), 'Q4_K').reshape(-1), 'Q4_K', tuple(w.shape))
    want = 10 * math.log10(w.float().pow(2).sum() / (dq - w.float()).pow(2).sum())
    row = next(r for r in d['layers'] if r['layer'] == 'encoder.layer.0.intermediate.dense' and r['label'] == 'GGUF Q4_K')
    assert abs(row['sqnr_db'] - want) < 1e-6 and row['bits_per_weight'] == 4.5
    q = cq.quantize(w, 'int8_tensorwise', per_row=True, rounding='exact')
    ex = next(r for r in d['layers'] if r['layer'] == 'encoder.layer.0.intermediate.dense' and r['label'] == 'INT8 (exact)')
    want = 10 * math.log10(w.float().pow(2).sum() / (q.dequantize(torch.float32) - w.float()).pow(2).sum())
    assert abs(ex['sqnr_db'] - want) < 1e-6
    assert set(d['front']) <= {c['label'] for c in d['candidates']} and 'INT8 (exact)' in d['front']
    assert all(c['layers'] == 2 for c in d['candidates'])


def test_compare_errors(bf16_file, tmp_path):
    path, _ = bf16_file
    rc, out, err = cquant_cli('compare', path, '--formats', 'Q4_X')
    assert rc != 0 and "compare: unknown format(s) ['q4_x']" in err and 'Traceback' not in err
    rc, out, err = cquant_cli('compare', path, '--layers', 'nothing-like-this')
    assert rc != 0 and "no float 2-D weight" in err and "'nothing-like-this'" in err
    q = tmp_path / 'q.safetensors'
    cq.save_file({'a.weight': cq.quantize(torch.randn(64, 64), 'float8_e4m3fn')}, q)
    rc, out, err = cquant_cli('compare', q)
    assert rc != 0 and 'no float 2-D weight' in err


def test_a_candidate_that_does_not_fit_leaves_the_layer_out():
    """W4A8's groups do not fit K = 40: that layer is left out of its totals, not an error; GGUF Q4_K stores it
    flattened to rows of 256 (64 x 40 = 10 rows); 64 x 33 fits neither K-quant rows nor rows of 256."""
    sd = {'a.weight': torch.randn(64, 40).bfloat16(), 'b.weight': torch.randn(64, 256).bfloat16(), 'c.weight': torch.randn(64, 33).bfloat16()}
    s = compare_weights(sd, candidates(['W4A8', 'Q4_K', 'NVFP4'], ('nearest',)))
    assert {r['label']: r['layers'] for r in s} == {'W4A8': 1, 'NVFP4': 3, 'GGUF Q4_K': 2}


@pytest.mark.long      # GPTQ and AWQ's search on a MiniLM layer, through the CLI
def test_compare_cli_gptq_and_calibrated_from_a_calibration_file(bf16_file, tmp_path):
    """`--roundings gptq` and `--calibrated` take the layers' inputs from `--calibration`: the numbers are those of
    quantize with the same inputs; without the file the command says what is missing."""
    path, ws = bf16_file
    g = torch.Generator().manual_seed(1)
    x = {n: torch.randn(2048, w.shape[1], generator=g) for n, w in ws.items()}
    cq.save_file(x, tmp_path / 'inputs.safetensors')
    rc, out, err = cquant_cli('compare', path, '--formats', 'INT8', 'AWQ W4A16', '--roundings', 'nearest', 'gptq',
                              '--calibrated', '--calibration', tmp_path / 'inputs.safetensors', '--json')
    assert rc == 0, err
    d = json.loads(out)
    assert [c['label'] for c in d['candidates']] == ['INT8', 'INT8 (gptq)', 'AWQ W4A16', 'AWQ W4A16 (calibrated)']
    n = 'encoder.layer.0.attention.self.query'
    w = ws[n]
    for label, q in (('INT8 (gptq)', cq.quantize(w, 'int8_tensorwise', per_row=True, rounding='gptq', calibration=x[n])),
                     ('AWQ W4A16 (calibrated)', cq.quantize(w, 'awq_w4a16', calibration=x[n]))):
        want = 10 * math.log10(w.float().pow(2).sum() / (q.dequantize(torch.float32) - w.float()).pow(2).sum())
        got = next(r for r in d['layers'] if r['layer'] == n and r['label'] == label)
        assert abs(got['sqnr_db'] - want) < 1e-6, label
    rc, out, err = cquant_cli('compare', path, '--formats', 'INT8', '--roundings', 'gptq')
    assert rc != 0 and "['INT8 (gptq)'] need calibration inputs" in err and 'Traceback' not in err


@pytest.mark.long      # the optional sdnq package's six encoders on two MiniLM layers
def test_sdnq_types_on_the_chart(bf16_file):
    "SDNQ's six types through its own package, beside the Comfy formats; its int8 is cquant's INT8 (exact), layer for layer."
    pytest.importorskip('sdnq')
    path, _ = bf16_file
    s = compare_weights(path, candidates(['sdnq', 'INT8'], ('nearest', 'exact')))
    assert {r['label'] for r in s if r['family'] == 'sdnq'} == {f'SDNQ {t}' for t in ('int4', 'uint4', 'int5', 'int6', 'int8', 'fp8')}
    by = {(r['layer'], r['label']): r['sqnr_db'] for r in s.layers}
    for layer in {l for l, _ in by}:
        assert abs(by[layer, 'SDNQ int8'] - by[layer, 'INT8 (exact)']) < 1e-9
    assert {r['label']: r['bits_per_weight'] for r in s}['SDNQ int4'] == 4.5


def test_sdnq_named_without_the_package(monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda n, *a: None if n == 'sdnq' else find(n, *a))
    with pytest.raises(ValueError, match=r"pip install 'cquant\[sdnq\]'"): candidates(['sdnq'])
    assert all(c.family != 'sdnq' for c in candidates())           # never in the default set
