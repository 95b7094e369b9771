"""The `cquant` command as people use it: each test runs the console script's `main` (in this process, or in a fresh
interpreter where only a process shows it: the entry point, signals, a closed pipe, a log) and checks its exit status
and what it printed."""
import json, os, random, re, subprocess, sys, warnings
from pathlib import Path

import pytest
import torch

import cquant as cq
from cquant.checkpoint import CheckpointWarning
from cquant.jobs import StreamingWriter, quantize_checkpoint
from cquant.plots import plot_report
from cquant.policy import PRESETS, Policy, PolicyWarning
from cquant.models import dit_state_dict
from cquant.tensor import format_color
from conftest import CLI_ENV as ENV, ROOT, cquant_cli as cquant


@pytest.fixture(scope='module')
def dit(tmp_path_factory):
    "A small bf16 DiT-shaped checkpoint (no known architecture: the auto preset notes that)."
    d = tmp_path_factory.mktemp('cli')
    cq.save_file(dit_state_dict(0, torch.bfloat16, depth=1), d / 'dit.safetensors')
    return d / 'dit.safetensors'


@pytest.fixture(scope='module')
def quantized(dit, tmp_path_factory):
    "`dit` quantized with the default policy (int4_mixed, preset auto)."
    dst = tmp_path_factory.mktemp('q') / 'q.safetensors'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        return dst, quantize_checkpoint(dit, dst, progress=False)


def test_version():
    rc, out, err = cquant('--version', fresh=True)
    assert (rc, out.strip(), err) == (0, f'cquant {cq.__version__}', '')


@pytest.mark.long
def test_presets_listed_and_spellings_accepted(dit):
    rc, out, _ = cquant('quantize', '--help')
    assert rc == 0 and 'hidream o1' in ' '.join(out.split()) and 'cquant presets' in out
    rc, out, _ = cquant('presets')
    assert rc == 0 and all(name in out for name in PRESETS)
    rc, out, _ = cquant('presets', '--json')
    assert {r['preset'] for r in json.loads(out)} == set(PRESETS)
    for spelling, name in (('hidream_o1', 'hidream o1'), ('HiDream.O1', 'hidream o1'), ('Z_Image', 'z-image'), ('minimax-h3', 'minimax_h3')):
        rc, out, err = cquant('plan', dit, '--preset', spelling, '--json')
        assert rc == 0 and json.loads(out)['preset'] == name, (spelling, err)
    rc, out, err = cquant('plan', dit, '--preset', 'fluxx')
    assert rc == 2 and "argument --preset: unknown preset 'fluxx': expected one of anima, auto, auto-conservative, boogu" in err


def test_no_architecture_note_is_one_line(dit):
    rc, out, err = cquant('plan', dit)
    assert rc == 0 and err.startswith('note: auto preset: no architecture recognised') and len(err.splitlines()) == 1, err
    assert 'warnings.warn' not in err and 'PolicyWarning' not in err


@pytest.mark.long
def test_json_on_stdout_for_every_command(dit, quantized, tmp_path):
    qdst, _ = quantized
    runs = {'formats': ['formats'], 'presets': ['presets'], 'plan': ['plan', dit, '--preset', 'none'],
            'inspect': ['inspect', qdst], 'report': ['report', dit, qdst],
            'quantize': ['quantize', dit, tmp_path / 'j.safetensors', '--preset', 'none', '--quiet', '--report', tmp_path / 'j.json'],
            'convert': ['convert', qdst, tmp_path / 'c.safetensors'], 'demo': ['demo', '--out', tmp_path / 'demo', '--source', 'dit', '--quiet']}
    got = {}
    for name, argv in runs.items():
        rc, out, err = cquant(*argv, '--json')
        assert rc == 0, (name, err)
        got[name] = json.loads(out)                              # the whole of stdout is one JSON document
    assert got['quantize'] == json.loads((tmp_path / 'j.json').read_text()) and got['quantize']['kind'] == 'quantize'
    assert got['report']['kind'] == 'error' and got['report']['totals']['quantized'] == quantized[1].totals['quantized']
    assert got['inspect']['total']['modules'] == quantized[1].totals['layers'] == 20 and got['convert']['legacy'] is None
    assert got['demo']['dst'].endswith('dit_int4_mixed.safetensors') and got['demo']['totals']['quantized'] > 0
    assert {r['format'] for r in got['formats']} == set(cq.FORMATS) and got['plan']['preset'] == 'none'


def test_report_of_unrelated_files_is_an_error(dit, tmp_path):
    other = tmp_path / 'other.safetensors'
    cq.save_file({'text.enc.weight': torch.randn(8, 16, dtype=torch.bfloat16)}, other)
    rc, out, err = cquant('report', dit, other)
    assert rc == 1 and out == '' and len(err.splitlines()) == 1
    assert 'shares no weights with' in err and 'source layers blocks.0.adaLN_modulation.1, blocks.0.attn.proj' in err
    assert 'quantized file layers text.enc' in err and 'inf dB' not in err


def test_no_sqnr_says_not_measured(dit, tmp_path):
    rc, out, err = cquant('quantize', dit, tmp_path / 'n.safetensors', '--preset', 'none', '--quiet', '--no-sqnr')
    assert rc == 0 and '; aggregate SQNR not measured' in out and 'inf dB' not in out, out[-500:]


@pytest.mark.long
def test_destination_checked_before_any_work(dit, tmp_path):
    missing = tmp_path / 'missing.safetensors'                    # would fail when read: the DST check comes first
    (tmp_path / 'out').mkdir()
    cases = [(tmp_path / 'out', f"the DST '{tmp_path / 'out'}' is a directory"),
             (tmp_path / 'nope' / 'x.safetensors', f"the DST '{tmp_path / 'nope' / 'x.safetensors'}' is in a folder that does not exist")]
    if os.geteuid() == 0: cases.append((Path('/proc/x.safetensors'), "the DST '/proc/x.safetensors' cannot be written: its folder '/proc' is not writable"))
    else:
        ro = tmp_path / 'ro'; ro.mkdir(); ro.chmod(0o500)
        cases.append((ro / 'x.safetensors', f"the DST '{ro / 'x.safetensors'}' cannot be written: its folder '{ro}' is not writable"))
    for dst, msg in cases:
        rc, out, err = cquant('quantize', missing, dst, '--quiet')
        assert rc == 1 and err.startswith(f'cquant quantize: error: {msg}') and 'missing.safetensors' not in err and '.spool' not in err, err
    assert os.listdir(tmp_path / 'out') == [] and [f for f in os.listdir(tmp_path) if f.startswith('.')] == []


@pytest.mark.long
def test_report_and_plot_paths_refused_before_any_work(dit, quantized, tmp_path):
    qdst, _ = quantized
    before = dit.read_bytes()
    dst = tmp_path / 'q.safetensors'
    for extra, msg in ((['--report', dit], f"the --report '{dit}' is the SRC file"), (['--plot', dst], f"the --plot '{dst}' is the DST file"),
                       (['--report', tmp_path / 'r', '--plot', tmp_path / 'r'], "the --plot '%s' is the --report file" % (tmp_path / 'r'))):
        rc, out, err = cquant('quantize', dit, dst, '--quiet', *extra)
        assert rc == 1 and msg in err, err
    rc, out, err = cquant('report', dit, qdst, '--report', qdst)
    assert rc == 1 and f"the --report '{qdst}' is the DST file" in err
    assert dit.read_bytes() == before and not dst.exists() and os.listdir(tmp_path) == []


@pytest.mark.long
def test_requantizing_needs_the_flag(tmp_path):
    g = torch.Generator().manual_seed(0)
    src = tmp_path / 'nv.safetensors'
    cq.save_file({'a.weight': cq.quantize(torch.randn(256, 256, generator=g), 'nvfp4'),
                  'b.weight': torch.randn(256, 256, generator=g).to(torch.bfloat16)}, src)
    rc, out, err = cquant('plan', src, '--preset', 'none')
    assert rc == 0 and '1 layer(s) stored quantized in the source; 1 would be quantized again' in out
    assert [l.split()[3] for l in out.splitlines() if l.startswith('a ')] == ['nvfp4']     # the `stored` column
    rc, out, err = cquant('plan', src, '--preset', 'none', '--json')
    assert json.loads(out)['stored_quantized'] == {'a': 'nvfp4'}
    dst = tmp_path / 'q.safetensors'
    rc, out, err = cquant('quantize', src, dst, '--preset', 'none', '--quiet')
    assert rc == 1 and 'already stores 1 of the layers to quantize quantized (nvfp4 1: a)' in err and '--requantize' in err
    assert not dst.exists()
    rc, out, err = cquant('quantize', src, dst, '--preset', 'none', '--quiet', '--requantize')
    assert rc == 0 and dst.exists()


def test_closed_stdout_ends_quietly(dit):
    p = subprocess.Popen([sys.executable, '-m', 'cquant.cli', 'plan', str(dit), '--preset', 'none'], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
    p.stdout.close()                                # like `| head` that has already exited
    err = p.stderr.read().decode(); rc = p.wait(timeout=120); p.stderr.close()
    assert rc == 141 and err == '', err


def test_ctrl_c_ends_with_one_line(dit, tmp_path):
    "SIGINT in the middle of writing: one line, status 130, no output or temporary file left."
    out_dir = tmp_path / 'o'; out_dir.mkdir()
    code = ("import os, signal, sys, cquant.jobs as cv\n"
            "orig, n = cv._write_quantized, [0]\n"
            "def slow(*a, **k):\n"
            "    n[0] += 1\n"
            "    if n[0] == 3: os.kill(os.getpid(), signal.SIGINT)\n"
            "    return orig(*a, **k)\n"
            "cv._write_quantized = slow\n"
            "from cquant.cli import main\n"
            f"sys.exit(main(['quantize', {str(dit)!r}, {str(out_dir / 'q.safetensors')!r}, '--preset', 'none', '--quiet']))")
    rc, out, err = cquant(code=code)
    assert (rc, err) == (130, 'cquant quantize: interrupted\n'), err
    assert os.listdir(out_dir) == []


@pytest.mark.long
def test_long_names_keep_columns_and_reasons_whole(tmp_path):
    long = 'model.diffusion_model.' + 'very_long_module_name_' * 3 + 'proj'
    src = tmp_path / 'l.safetensors'
    g = torch.Generator().manual_seed(0)
    cq.save_file({long + '.weight': torch.randn(64, 256, generator=g).to(torch.bfloat16),
                  'short.weight': torch.randn(64, 256, generator=g).to(torch.bfloat16)}, src)
    dst = tmp_path / 'q.safetensors'
    rc, out, err = cquant('quantize', src, dst, '--preset', 'none', '--quiet', '--mode', 'int8', '--keep-float', 'short')
    assert rc == 0
    rc, out, err = cquant('inspect', dst)
    lines = out.splitlines()
    col = next(l for l in lines if l.startswith('module ')).index('format')       # the format column, from the header
    rows = [l for l in lines if l.startswith((long + ' ', 'short '))]
    assert [l[col - 2:].split()[0] for l in rows] == ['int8_tensorwise', '-'] and all(l[col - 2:col] == '  ' for l in rows), out
    assert 'x smaller than bf16' in out or 'x larger than bf16' in out
    rc, narrow, _ = cquant('plan', src, '--preset', 'none')
    rc, wide, _ = cquant('plan', src, '--preset', 'none', '--wide')
    plan = Policy(preset='none').plan(src)
    assert max(len(d.reason) for d in plan.values()) > 70 and '...' not in narrow                       # one reason wraps
    for name in (long, 'short'):
        assert any(l.startswith(name + ' ') and l.endswith(plan[name].reason) for l in wide.splitlines())   # --wide: one line
        assert ' '.join(plan[name].reason.split()) in ' '.join(narrow.split())                              # wrapped, whole
    assert max(len(l) for l in narrow.splitlines()) < max(len(l) for l in wide.splitlines())
    assert all(w in narrow.split() for d in plan.values() for w in d.reason.split())                        # no word cut


@pytest.mark.long
def test_size_ratios_say_what_they_compare(dit, quantized):
    qdst, rep = quantized
    rc, out, _ = cquant('inspect', dit)
    assert rc == 0 and 'the same size as bf16' in out
    rc, out, _ = cquant('inspect', qdst)
    assert f"{4.0:.2f}x" not in out and 'x smaller than bf16' in out
    rc, out, _ = cquant('report', dit, qdst)
    t = rep.totals
    assert rc == 0 and f"({t['bytes_before'] / t['bytes_after']:.2f}x smaller than the source)" in out


@pytest.mark.long
@pytest.mark.skipif('asym_w4a8_int8' not in cq.FORMATS, reason='the W4A8 layout is not registered')
def test_weight_correction_warned_and_flagged(tmp_path):
    g = torch.Generator().manual_seed(0)
    asym = cq.quantize(torch.randn(64, 256, generator=g), 'asym_w4a8_int8', symmetric=False)
    sym = cq.quantize(torch.randn(64, 256, generator=g), 'asym_w4a8_int8')
    p = tmp_path / 'asym.safetensors'
    with pytest.warns(CheckpointWarning, match=r"1 module\(s\) store weight_correction, which ComfyUI's loader never reads.*\(blk\.a\)"):
        cq.save_file({'blk.a.weight': asym, 'blk.b.weight': sym}, p)
    with pytest.warns(CheckpointWarning, match=r'\(blk\.a\)'), StreamingWriter(tmp_path / 's.safetensors') as w:
        for k, t in {**asym.state_dict('blk.a.'), 'blk.a.comfy_quant': cq.encode_json(asym.config)}.items(): w.add(k, t)
    with warnings.catch_warnings():
        warnings.simplefilter('error', CheckpointWarning)
        cq.save_file({'blk.b.weight': sym}, tmp_path / 'sym.safetensors')        # symmetric: nothing to warn about
    rc, out, err = cquant('inspect', p)
    assert rc == 0 and "warning: blk.a stores weight_correction, which ComfyUI's loader never reads" in out and 'blk.b stores' not in out
    rc, out, err = cquant('inspect', p, '--json')
    assert json.loads(out)['comfy_unread'] == {'blk.a': ['weight_correction']}
    rc, out, err = cquant('convert', p, tmp_path / 'c.safetensors')
    assert rc == 0 and err.startswith('warning: ') and 'weight_correction' in err and len(err.splitlines()) == 1, err
    src = tmp_path / 'w.safetensors'
    cq.save_file({'blk.a.weight': torch.randn(64, 256, generator=g).to(torch.bfloat16),
                  'blk.b.weight': torch.randn(64, 256, generator=g).to(torch.bfloat16)}, src)
    pol = Policy('w4a8', 'none', overrides=(('blk.a', 'asym_w4a8_int8', {'symmetric': False}),))
    with pytest.warns(CheckpointWarning, match=r'\(blk\.a\)'):
        quantize_checkpoint(src, tmp_path / 'q.safetensors', pol, progress=False)
    (tmp_path / 'pol.json').write_text(pol.to_json())
    rc, out, err = cquant('quantize', src, tmp_path / 'q2.safetensors', '--policy', tmp_path / 'pol.json', '--quiet', '--json')
    assert rc == 0 and json.loads(out)['kind'] == 'quantize'
    assert err.startswith('warning: ') and "(blk.a); for ComfyUI quantize asym_w4a8_int8 with symmetric=True" in err and len(err.splitlines()) == 1


def _legend(fig) -> dict:
    leg = fig.axes[0].get_legend()
    return {t.get_text(): (tuple(h.get_facecolor()), h.get_hatch()) for t, h in zip(leg.get_texts(), leg.legend_handles)}


@pytest.mark.long
def test_plot_colours_are_fixed_per_format(dit, quantized, tmp_path):
    from matplotlib.colors import to_rgba
    _, rep = quantized
    fig = plot_report(rep)
    got = _legend(fig)
    fmt = {r['label']: r['format'] for r in rep.quantized()}
    assert {k.rsplit(' (', 1)[0] for k in got} == set(fmt) == {'W4A4', 'INT8 ConvRot'}
    for k, (colour, _) in got.items(): assert colour == to_rgba(format_color(fmt[k.rsplit(' (', 1)[0]]))
    assert len({c for c, _ in got.values()}) == 2 and format_color('convrot_w4a4') != format_color('int8_tensorwise')
    shuffled = type(rep)(rep.src, rep.dst, random.Random(0).sample(rep.layers, len(rep.layers)), rep.totals)
    assert _legend(plot_report(shuffled)) == got
    names = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert len(names) == len(rep.quantized()) and all(len(n) <= 32 for n in names)
    import importlib
    assert importlib.import_module('cquant.explore').format_color is format_color      # one palette for every plot
    rc, out, err = cquant('quantize', dit, tmp_path / 'p.safetensors', '--quiet', '--plot', tmp_path / 'p.png')
    assert rc == 0 and (tmp_path / 'p.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.long
def test_quantize_svdquant_with_calibration_file(tmp_path, capsys):
    "`cquant quantize --mode svdquant --calibration FILE`: the calibrated SVDQuant layers, and inspect's loader warning."
    from cquant.cli import main
    model = cq.dit_model(0)
    src, cal, dst = tmp_path / 'dit.safetensors', tmp_path / 'cal.safetensors', tmp_path / 'q.safetensors'
    cq.save_file(model.state_dict(), src)
    inputs = cq.collect_inputs(model, cq.dit_batches(1, 2, 32, seed=1))
    cq.save_file({k: v.contiguous() for k, v in inputs.items()}, cal)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        assert main(['quantize', str(src), str(dst), '--mode', 'svdquant', '--calibration', str(cal), '--quiet', '--json']) == 0
    rep = json.loads(capsys.readouterr().out)
    svdq = [r for r in rep['layers'] if r['format'] == 'svdquant_w4a4']
    assert len(svdq) > 10 and all(r['name'] in inputs for r in svdq)
    sd = cq.load_file(dst)
    r = svdq[0]['name']
    assert cq.decode_json(sd[r + '.comfy_quant'])['format'] == 'svdquant_w4a4'
    assert any(not torch.all(sd[x['name'] + '.weight_smooth_factor'] == 1) for x in svdq)   # calibrated (data-free: 1)
    assert main(['inspect', str(dst)]) == 0
    assert "which ComfyUI's core loader does not register" in capsys.readouterr().out


@pytest.mark.long
def test_messages_name_the_flag_and_the_file(dit, quantized, tmp_path):
    """Errors a CLI user can trigger name the flag or the file and say what would work: --ratio and
    --convrot-groupsize at parse time (exit 2, usage), a missing file without `[Errno N]`, `report` with its two files
    swapped."""
    rc, out, err = cquant('plan', dit, '--ratio', '2')
    assert rc == 2 and "argument --ratio: expected a share of the W4-compatible layers in [0, 1]" in err and "found '2'" in err
    rc, out, err = cquant('plan', dit, '--convrot-groupsize', '100')
    assert rc == 2 and "argument --convrot-groupsize: expected 'auto' or a power of 4 (16, 64, 256, 1024, ...), found '100'" in err
    rc, out, err = cquant('plan', dit, '--convrot-groupsize', '64', '--ratio', '0.5', '--json')
    assert rc == 0, err
    rc, out, err = cquant('inspect', tmp_path / 'missing.safetensors')
    assert rc == 1 and err.strip() == f"cquant inspect: error: {tmp_path / 'missing.safetensors'}: no such file or directory"
    rc, out, err = cquant('report', quantized[0], dit)
    assert rc == 1 and out == '' and 'expected the float original first, then the quantized file made from it (swapped?' in err


@pytest.mark.long
def test_a_folder_holding_one_checkpoint_is_read(dit, tmp_path):
    "A model folder with one .safetensors file (what `fetch-minilm` writes) reads as that file; two are named as ambiguous."
    d = tmp_path / 'model'; d.mkdir()
    (d / 'model.safetensors').write_bytes(Path(dit).read_bytes()); (d / 'vocab.txt').write_text('x')
    rc, out, err = cquant('inspect', d)
    assert rc == 0 and out.startswith(f"{d / 'model.safetensors'}:"), err
    rc, out, err = cquant('quantize', d, tmp_path / 'q.safetensors', '--mode', 'int8', '--quiet')
    assert rc == 0 and (tmp_path / 'q.safetensors').exists(), err
    (d / 'other.safetensors').write_bytes(Path(dit).read_bytes())
    rc, out, err = cquant('inspect', d)
    assert rc == 1 and "a directory with no '*.safetensors.index.json' (not a sharded checkpoint folder) and 2 '.safetensors' files: name the file" in err


def test_progress_is_quiet_in_a_log(tmp_path):
    "With stderr not a terminal (a log, CI) the progress bar draws at most every 10 s, not once per tensor."
    cq.save_file(dit_state_dict(0, torch.bfloat16, depth=2), tmp_path / 'd.safetensors')
    rc, out, err = cquant('quantize', tmp_path / 'd.safetensors', tmp_path / 'q.safetensors', fresh=True)
    assert rc == 0 and err.count('%|') <= 4 and err.count('tensors,') == 0, err


def test_the_cost_of_a_run_is_shown(dit, tmp_path):
    """The summary says what the job cost (seconds and their split, rate, peak memory, slowest layers), the report file
    (and `--json`, the same `Report.to_dict`) carries it, and the progress line in a log shows the rate and the time
    left (issue 37)."""
    rc, out, err = cquant('quantize', dit, tmp_path / 'q.safetensors', '--preset', 'none', '--report', tmp_path / 'r.json')
    assert rc == 0 and re.search(r'^cost: [\d.]+ s \(reading [\d.]+ s, computing [\d.]+ s, writing [\d.]+ s\), [\d.]+ \w+/s', out, re.M), out
    assert 'slowest: ' in out and re.search(r'\[\d\d:\d\d<[^,]*, [^\]]*B/s', err), err     # tqdm: elapsed<left, rate
    cost = json.loads((tmp_path / 'r.json').read_text())['cost']     # what --report and --json write (Report.to_dict)
    assert cost['seconds'] > 0 and cost['slowest'] and abs(cost['read_s'] + cost['write_s'] + cost['compute_s'] - cost['seconds']) < 1e-6


def test_every_help_teaches():
    """Every subcommand's --help has a description and an example that parses (issue 42); the top-level help and the
    README give the exit statuses."""
    import shlex
    from cquant.cli import EXAMPLES, build_parser
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == 'command')
    assert set(sub.choices) == set(EXAMPLES)
    for name, f in sub.choices.items():
        text = f.format_help()
        assert f.description and f.description.endswith('.'), name
        assert f'example:\n  {EXAMPLES[name]}' in text, name
        argv = shlex.split(EXAMPLES[name])
        assert argv[:2] == ['cquant', name] and p.parse_args(argv[1:]).command == name
    rc, out, _ = cquant('--help')
    assert rc == 0 and 'exit status:' in out and '2    usage' in out
    rc, out, _ = cquant('plan', '--help')
    table = out[out.index('modes (bits per weight'):].split('\n\n')[0]
    rows = {l.split()[0]: l.split() for l in table.splitlines()[3:] if l[:3].strip()}
    from cquant.policy import MODES
    assert set(rows) == set(MODES)
    assert rows['nvfp4'][1:5] == ['NVFP4', '4.50', 'CUDA', 'sm'] and rows['int4_mixed'][1:3] == ['W4A4', '4.01'], rows
    assert 'INT8 ConvRot   8.01' in out and '--calibration feeds its' in out   # int4_mixed's INT8 share; svdquant's encoder
    readme = (ROOT / 'README.md').read_text()
    assert 'The exit status is 0' in readme and '2 for a wrong flag' in readme


def test_answers_without_torch():
    """--version, every --help and argument errors are answered before torch is imported (issue 42: well under half a
    second; `bench/README.md` has the times)."""
    code = """import sys, contextlib, io
from cquant.cli import main
for argv in (['--version'], ['--help'], ['quantize', '--help'], ['merge-lora', '--help'], ['quantize', 'a', 'b', '--ratio', '2'],
             ['plan', 'x', '--preset', 'fluxx'], ['validate', 'x', '--comfyui', '2020'], ['quantize', 'a', 'b', '--shard-size', '5XB']):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try: code = main(argv)
        except SystemExit as e: code = e.code
    print(argv, code)
print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'safetensors')))"""
    rc, out, err = cquant(code=code)
    assert rc == 0 and out.splitlines()[-1] == '[]', (out, err)
    assert [l.rsplit(' ', 1)[1] for l in out.splitlines()[:-1]] == ['0'] * 4 + ['2'] * 4   # nbs/18_cli checks the facts are current


def test_plan_says_each_reason_once(tmp_path):
    """On MiniLM's shapes (K = 384, which ConvRot group 256 does not divide) `plan` says each cause once: repeated
    reasons become marks [n] with one note each, and the fallback names the group that would fit (issue 42)."""
    import re
    from collections import Counter
    from cquant.minilm import minilm_model
    from cquant.plain import _FOOTNOTE_LEAST as FOOTNOTE_LEAST
    cq.save_file({k: v.contiguous() for k, v in minilm_model().state_dict().items()}, tmp_path / 'm.safetensors')
    rc, out, err = cquant('plan', tmp_path / 'm.safetensors', '--wide')
    assert rc == 0, err
    lines = out.splitlines()
    rows = lines[2:lines.index('')]
    reasons = Counter(re.split(r'\s{2,}', l.strip(), maxsplit=3)[-1] for l in rows)
    assert all(n < FOOTNOTE_LEAST or re.fullmatch(r'\[\d+\]', r) for r, n in reasons.items()), reasons
    notes = [l for l in lines if re.match(r'\[\d+\] ', l)]
    assert len(notes) == sum(1 for r in reasons if r.startswith('[')) >= 1
    why = "W4A4 does not fit: ConvRot group 256 does not divide K=384; convrot_groupsize='auto' (--convrot-groupsize auto) fits 64"
    assert out.count(why) == 1 and any(why in n for n in notes)


@pytest.mark.long
def test_repeated_warnings_are_counted(dit, tmp_path):
    """The same warning about many layers is one line and a count (issue 42): svdquant without calibration warns per
    layer that it uses its data-free variant."""
    rc, out, err = cquant('quantize', dit, tmp_path / 's.safetensors', '--mode', 'svdquant', '--quiet', '--no-sqnr')
    assert rc == 0, err
    said = [l for l in err.splitlines() if "calibrates on the layer's inputs and none were given" in l]
    plan = json.loads(cquant('plan', dit, '--mode', 'svdquant', '--json')[1])['layers']
    n = sum(1 for d in plan.values() if d['format'] == 'svdquant_w4a4')
    assert n > 2 and len(said) == 2, err
    assert said[0].startswith('warning: ') and said[1].startswith(f'warning: the same for {n - 1} more layers ('), err


def test_validate_says_a_message_once(quantized):
    """`validate` on a file whose modules share a warning prints it once, as a note the rows point to (issue 42)."""
    import re
    rc, out, err = cquant('validate', quantized[0])
    assert rc == 0, err
    notes = [l for l in out.splitlines() if re.match(r'\[\d+\] \d+ layers: ', l)]
    assert notes and all(out.count(n.split(' layers: ', 1)[1]) == 1 for n in notes)
    assert sum(int(n.split()[1]) for n in notes) == sum(1 for l in out.splitlines() if re.search(r'warning\s+\[\d+\]$', l))


def test_every_data_file_is_package_data():
    "Each file in cquant/data matches a [tool.setuptools.package-data] glob, so a wheel carries it (the CLI reads its facts there)."
    import fnmatch, tomllib
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root/'pyproject.toml').read_text())['tool']['setuptools']['package-data']['cquant']
    files = sorted(p.relative_to(root/'cquant').as_posix() for p in (root/'cquant'/'data').iterdir())
    assert 'data/cli_facts.json' in files and [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == [], globs
