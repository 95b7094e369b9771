"""convert_to_quant's formats against convert_to_quant 1.3.4 itself: its layout encoders byte for byte, and files its CLI
writes read (and rewritten) by cquant with the same bytes. Skipped where convert_to_quant is not installed."""
import json, shutil, subprocess, sys
import pytest
import torch
from safetensors.torch import save_file, load_file
import cquant as cq
from cquant.quantops import quantize_fp8_rowwise, quantize_fp8_blockwise, quantize_int8_blockwise, scaled, hybrid_scalar

ctq = pytest.importorskip('convert_to_quant.comfy.quant_ops')
CLI = shutil.which('convert_to_quant')


def weights():
    "Weights that reach the encoders' edges: decades of row magnitude, zero rows and tiles, tiny and huge values."
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 384, generator=g) * torch.logspace(-4, 1, 256)[:, None]
    w[5] = 0; w[64:128, 128:192] = 0; w[9, 3] = 3e4; w[10] = 1e-30
    return w


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_encoders_match_convert_to_quant(dtype):
    "Codes and scales byte-identical to convert_to_quant's layouts (on the fp32 copy its CLI quantizes)."
    w = weights().to(dtype)
    w32 = w.float()
    q, s = quantize_fp8_rowwise(w)
    rq, rp = ctq.RowWiseFP8Layout.quantize(w32)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rp['scale'])
    for g in (64, 128):
        q, s = quantize_fp8_blockwise(w, g)
        rq, rp = ctq.BlockWiseFP8Layout.quantize(w32, block_size=g)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rp['scale']), g
        q, s = quantize_int8_blockwise(w, g)
        rq, rp = ctq.BlockWiseINT8Layout.quantize(w32, block_size=g, is_weight=True)
        assert torch.equal(q, rq) and torch.equal(s, rp['scale']), g


def test_decoders_match_convert_to_quant():
    "fp32 decodes equal convert_to_quant's dequantize of the same storage."
    w = weights()
    q, s = quantize_fp8_rowwise(w)
    assert torch.equal(scaled(q, s, torch.float32), ctq.RowWiseFP8Layout.dequantize(q, s, torch.float32))
    q, s = quantize_fp8_blockwise(w, 64)
    assert torch.equal(scaled(q, s, torch.float32), ctq.BlockWiseFP8Layout.dequantize(q, s, 64, torch.float32))
    q, s = quantize_int8_blockwise(w, 128)
    assert torch.equal(scaled(q, s, torch.float32),
                       ctq.BlockWiseINT8Layout.dequantize(q, s, 128, is_weight=True, orig_dtype=torch.float32))


SOURCE_SHAPES = {'blocks.0.attn.qkv': (384, 256), 'blocks.0.attn.proj': (256, 128), 'blocks.1.mlp.fc1': (320, 192)}
RUNS = {   # format -> the convert_to_quant arguments that write it
    'float8_e4m3fn_rowwise': ['--scaling_mode', 'row'],
    'float8_e4m3fn_blockwise': ['--scaling_mode', 'block', '--block_size', '64'],
    'int8_blockwise': ['--int8', '--scaling_mode', 'block', '--block_size', '64'],
    'hybrid_mxfp8': ['--mxfp8'],
}


# the CLI's entry point (what the `convert_to_quant` script calls) for each argument list, in one interpreter: torch and
# convert_to_quant imported once instead of five times (3 s each)
_CLI_RUNS = """import json, sys
from convert_to_quant.convert_to_quant import main
for argv in json.loads(sys.argv[1]):
    sys.argv = ['convert_to_quant', *argv]
    rc = main()
    if rc: sys.exit(f"convert_to_quant {' '.join(argv)}: exit {rc}")
"""


@pytest.fixture(scope='module')
def ctq_files(tmp_path_factory):
    "A bf16 source and the file convert_to_quant's CLI writes from it in each format."
    if CLI is None: pytest.skip('the convert_to_quant CLI is not installed')
    d = tmp_path_factory.mktemp('ctq')
    g = torch.Generator().manual_seed(3)
    sd = {f'{m}.weight': (torch.randn(*s, generator=g) * 0.05).bfloat16() for m, s in SOURCE_SHAPES.items()}
    save_file(sd, d / 'src.safetensors')
    common = ['--comfy_quant', '--simple', '--device', 'cpu', '--verbose', 'MINIMAL']
    runs = [['-i', str(d / 'src.safetensors'), '-o', str(d / f'{fmt}.safetensors'), *common, *args] for fmt, args in RUNS.items()]
    runs.append(['-i', str(d / 'hybrid_mxfp8.safetensors'), '-o', str(d / 'hybrid.safetensors'), '--make-hybrid-mxfp8',
                 '--verbose', 'MINIMAL'])
    r = subprocess.run([sys.executable, '-c', _CLI_RUNS, json.dumps(runs)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return d / 'src.safetensors', {fmt: d / f"{'hybrid' if fmt == 'hybrid_mxfp8' else fmt}.safetensors" for fmt in RUNS}


@pytest.mark.long                 # convert_to_quant's CLI, five runs (once: one worker holds the fixture)
@pytest.mark.xdist_group('ctq')
@pytest.mark.parametrize('fmt', list(RUNS))
def test_convert_to_quant_files_load(ctq_files, fmt):
    "cquant validates the CLI's file, loads every module in its format and decodes it as the format defines."
    _, files = ctq_files
    sd = load_file(files[fmt])
    rep = cq.validate(files[fmt])
    assert [r['status'] for r in rep.rows if r['format'] == fmt] == ['warning'] * 3, rep.rows
    assert all(any('ComfyUI-QuantOps' in m['message'] for m in r['messages']) for r in rep.rows if r['format'] == fmt)
    for m, shape in SOURCE_SHAPES.items():
        qt = cq.load_quantized(sd, m)
        assert qt.format == fmt and tuple(qt.shape) == shape
        if fmt == 'hybrid_mxfp8':
            assert torch.equal(qt.params.scalar, hybrid_scalar(sd[m + '.weight_scale']))
            continue
        s, q = sd[m + '.weight_scale'], sd[m + '.weight']
        want = (ctq.RowWiseFP8Layout.dequantize(q, s, torch.float32) if s.dim() == 1 else
                ctq.BlockWiseFP8Layout.dequantize(q, s, 64, torch.float32) if q.dtype == torch.float8_e4m3fn else
                ctq.BlockWiseINT8Layout.dequantize(q, s, 64, is_weight=True, orig_dtype=torch.float32))
        assert torch.equal(qt.dequantize(torch.float32), want)


@pytest.mark.long                 # convert_to_quant's CLI, five runs (once: one worker holds the fixture)
@pytest.mark.xdist_group('ctq')
@pytest.mark.parametrize('fmt', list(RUNS))
def test_cquant_writes_what_convert_to_quant_writes(ctq_files, fmt, tmp_path):
    "quantize_checkpoint in the same format writes the CLI's weight and scale bytes (biases aside: the CLI corrects them)."
    src, files = ctq_files
    opts = {'group_size': 64} if 'group_size' in cq.FORMATS[fmt].option_names else {}
    dst = tmp_path / 'cq.safetensors'
    cq.quantize_checkpoint(src, dst, cq.Policy(preset='none', overrides=(('re:.', fmt, opts),)))
    ours, theirs = load_file(dst), load_file(files[fmt])
    for m in SOURCE_SHAPES:
        for k in cq.FORMATS[fmt].weight_keys:
            if m + '.' + k not in theirs: continue
            a, b = ours[f'{m}.{k}'], theirs[f'{m}.{k}']
            assert a.dtype in (b.dtype, torch.float8_e8m0fnu) and a.shape == b.shape, (m, k, a.dtype, b.dtype)
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b), (m, k)
        cfg, want = json.loads(bytes(ours[m + '.comfy_quant'].tolist())), json.loads(bytes(theirs[m + '.comfy_quant'].tolist()))
        assert cfg['format'] == want['format'] and cfg.get('group_size') == (want.get('group_size') if opts else None)


@pytest.mark.long
@pytest.mark.xdist_group('ctq')
@pytest.mark.writes_invalid      # the legacy file, on purpose
@pytest.mark.parametrize('fmt', ['int8_blockwise'])
def test_legacy_int8_converts_to_the_marked_file(ctq_files, fmt, tmp_path):
    """INT8 stored the legacy way (`scale_weight` / `scale_input`, no marker, as older writers left it): validate explains it,
    `cquant convert` writes what convert_to_quant's marked file holds, codes and scales byte for byte."""
    _, files = ctq_files
    marked = load_file(files[fmt])
    legacy = {k.replace('.weight_scale', '.scale_weight').replace('.input_scale', '.scale_input'): v
              for k, v in marked.items() if not k.endswith('.comfy_quant')}
    src, dst = tmp_path / 'legacy.safetensors', tmp_path / 'converted.safetensors'
    save_file(legacy, src)
    rows = cq.validate(src).rows
    assert {r['status'] for r in rows if r['module'] in SOURCE_SHAPES} == {'error'}
    assert all('`cquant convert` rewrites it as int8_blockwise, its bytes kept' in r['messages'][0]['message']
               for r in rows if r['module'] in SOURCE_SHAPES)
    r = subprocess.run(['cquant', 'convert', str(src), str(dst)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'legacy INT8 marked: ' in r.stdout, r.stdout + r.stderr
    out = load_file(dst)
    for m in SOURCE_SHAPES:
        assert torch.equal(out[m + '.weight'], marked[m + '.weight']) and torch.equal(out[m + '.weight_scale'], marked[m + '.weight_scale'])
        assert json.loads(bytes(out[m + '.comfy_quant'].tolist())) == {'format': fmt, 'group_size': 64}
        assert m + '.scale_input' not in out and m + '.scale_weight' not in out
    assert all(r['status'] != 'error' for r in cq.validate(dst).rows)
