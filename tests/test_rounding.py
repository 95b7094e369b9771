"""rounding='mse' and rounding='gptq' (cquant.rounding): better than nearest where they claim to be, the same files,
clear errors and warned fallbacks, and the policy / model / checkpoint / CLI plumbing."""
import os, warnings
import pytest
import torch
import cquant as cq
from cquant.numerics import sqnr
from cquant.rounding import GPTQWarning, gptq_rounding, mse_rounding
from cquant.calibrate import CalibrationWarning

GRIDDED = [(f, o) for f, o in (('float8_e4m3fn', {}), ('nvfp4', {}), ('int8_tensorwise', {}),
                               ('int8_tensorwise', {'per_row': True}),
                               ('int8_tensorwise', {'convrot': True, 'convrot_groupsize': 64}),
                               ('convrot_w4a4', {'convrot_groupsize': 64}))]


def weight(N=96, K=256, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.05
    w[torch.randint(0, N, (12,), generator=g), torch.randint(0, K, (12,), generator=g)] *= 10
    return w.to(dtype)


def inputs(M, K, seed):
    "Correlated inputs with a few loud channels, like a transformer's."
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=torch.Generator().manual_seed(99)) / K ** 0.5
    x = torch.randn(M, K, generator=g) @ (torch.eye(K) + mix)
    x[:, :4] *= 8
    return x


def out_sqnr(w, qt, x): return sqnr(x @ w.float().T, x @ qt.dequantize(torch.float32).T)


@pytest.mark.parametrize('fmt,opts', GRIDDED, ids=lambda v: str(v))
@pytest.mark.parametrize('dtype', (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_mse_never_worse_than_nearest(fmt, opts, dtype):
    w = weight(dtype=dtype)
    near, mse = cq.quantize(w, fmt, **opts), cq.quantize(w, fmt, rounding='mse', **opts)
    assert sqnr(w.float(), mse.dequantize(torch.float32)) >= sqnr(w.float(), near.dequantize(torch.float32))


@pytest.mark.parametrize('fmt,opts', GRIDDED, ids=lambda v: str(v))
def test_gptq_beats_nearest_on_held_out_inputs(fmt, opts):
    w, cal, held = weight(), inputs(512, 256, 1), inputs(256, 256, 2)
    near = cq.quantize(w, fmt, **opts)
    gptq = cq.quantize(w, fmt, rounding='gptq', calibration=cal, **opts)
    assert out_sqnr(w, gptq, held) > out_sqnr(w, near, held) + 0.5, fmt


def test_mse_and_gptq_gain_on_4bit():
    "The 4-bit formats gain the most: MSE >= +0.5 dB weight SQNR, GPTQ >= +3 dB output SQNR (measured about +1.3 / +6)."
    w, cal, held = weight(), inputs(512, 256, 1), inputs(256, 256, 2)
    for fmt, opts in (('convrot_w4a4', {'convrot_groupsize': 64}), ('nvfp4', {})):
        near = cq.quantize(w, fmt, **opts)
        mse = cq.quantize(w, fmt, rounding='mse', **opts)
        gptq = cq.quantize(w, fmt, rounding='gptq', calibration=cal, **opts)
        assert sqnr(w, mse.dequantize(torch.float32)) >= sqnr(w, near.dequantize(torch.float32)) + 0.5, fmt
        assert out_sqnr(w, gptq, held) >= out_sqnr(w, near, held) + 3, fmt


def test_gptq_input_errors_name_the_layer():
    w = weight()
    spec, opts = cq.get_format('convrot_w4a4'), {'convrot_groupsize': 64, 'linear_dtype': 'int4'}
    with pytest.raises(ValueError, match=r"calibration of blk\.fc\.weight.*inputs \[\.\.\., 256\].*shape \(40, 128\)"):
        cq.quantize(w, 'convrot_w4a4', rounding='gptq', calibration=torch.randn(40, 128), name='blk.fc.weight')
    x = inputs(64, 256, 1); x[3, 5] = float('nan')
    with pytest.raises(ValueError, match=r"calibration of blk\.fc\.weight.*finite inputs.*1 NaN/inf"):
        cq.quantize(w, 'convrot_w4a4', rounding='gptq', calibration=x, name='blk.fc.weight')
    with pytest.raises(ValueError, match="layer inputs"):
        gptq_rounding(spec, w, opts, None, 'blk.fc.weight')


def test_gptq_fallbacks_warn_and_round_mse():
    w = weight()
    spec, opts = cq.get_format('convrot_w4a4'), cq.get_format('convrot_w4a4').resolve(None, convrot_groupsize=64)
    mse = mse_rounding(spec, w, opts)
    with pytest.warns(GPTQWarning, match=r"blk\.fc\.weight: 8 calibration rows .* too few"):
        few = gptq_rounding(spec, w, opts, inputs(8, 256, 1), 'blk.fc.weight')
    assert torch.equal(few[0], mse[0]) and torch.equal(few[1].scale, mse[1].scale)
    singular = torch.ones(64, 256)                        # rank 1, and no dampening to rescue it
    with pytest.warns(GPTQWarning, match=r"blk\.fc\.weight: the GPTQ Hessian stays singular"):
        sing = gptq_rounding(spec, w, opts, singular, 'blk.fc.weight', damp=0.0)
    assert torch.equal(sing[0], mse[0])


def test_policy_rounding_plumbing(tmp_path):
    model = cq.dit_model(0)
    batches = cq.dit_batches(1, 2, 32, seed=1)
    policy = cq.Policy(mode='int4_full', rounding='gptq')
    plan = policy.plan(model)
    assert {d.rounding for d in plan.values() if d.format} == {'gptq'}
    assert all(d.reason.endswith('; rounding gptq') for d in plan.values() if d.format)
    with pytest.raises(ValueError, match="rounding='gptq' for .* needs calibration inputs"):
        cq.quantize_model(cq.dit_model(0), plan)
    q = cq.quantize_model(cq.dit_model(0), plan, calibration=batches)
    near = cq.quantize_model(cq.dit_model(0), cq.Policy(mode='int4_full').plan(model))
    held = cq.dit_batches(1, 2, 32, seed=2)[0]
    with torch.no_grad():
        ref = model(*held)
        assert sqnr(ref, q(*held)) > sqnr(ref, near(*held)) + 1      # measured about +3 dB


def test_checkpoint_gptq_report_and_file(tmp_path):
    src, dst = tmp_path / 'dit.safetensors', tmp_path / 'q.safetensors'
    model = cq.dit_model(0)
    cq.save_file(model.state_dict(), src)
    cal = cq.collect_inputs(model, cq.dit_batches(1, 2, 32, seed=1))
    policy = cq.Policy(mode='int4_full', rounding='gptq')
    some = next(n for n, d in policy.plan(model).items() if d.format and n in cal)
    del cal[some]                                         # one layer without inputs: MSE, with a warning naming it
    short = next(n for n, d in policy.plan(model).items() if d.format and n in cal and 'experts' not in n)
    cal[short] = cal[short][:8]                           # too few rows: GPTQ falls back to MSE, reported as MSE
    with pytest.warns(CalibrationWarning, match=f"{some}: rounding='gptq' needs the layer's calibration inputs"), \
         pytest.warns(GPTQWarning, match=f"{short}.weight: 8 calibration rows"):
        rep = cq.quantize_checkpoint(src, dst, policy, progress=False, calibration=cal)
    rows = {r['name']: r for r in rep.layers if r['format']}
    assert rows[some]['rounding'] == 'mse' and 'output_sqnr_db' not in rows[some]
    assert rows[short]['rounding'] == 'mse' and 'output_sqnr_db' in rows[short]
    gptq = [r for r in rows.values() if r['rounding'] == 'gptq']
    assert 0 < len(gptq) <= len(rows) - 2
    routed = [r for r in gptq if 'experts' in r['name']]     # MoE experts see few routed rows: MSE fallback inside
    assert all(r['output_gain_db'] > 0 for r in gptq if r not in routed), [(r['name'], r['output_gain_db']) for r in gptq]
    assert 'out gain' in rep.table() and 'gain dB' in rep.table()
    sd = cq.load_file(dst)
    for name, r in rows.items():          # what the report measured is what the file holds
        qt = cq.load_quantized(sd, name + '.', dtype=torch.float32)
        assert abs(sqnr(model.get_submodule(name).weight.detach(), qt.dequantize()) - r['sqnr_db']) < 1e-3, name


def test_cli_rounding(tmp_path, capsys):
    from cquant.cli import main
    src = tmp_path / 'dit.safetensors'
    cq.save_file(cq.dit_state_dict(0), src)
    assert main(['quantize', str(src), str(tmp_path / 'g.safetensors'), '--rounding', 'gptq', '--quiet']) == 1
    assert "needs calibration inputs" in (err := capsys.readouterr().err) and 'on the command line --calibration FILE' in err
    assert main(['quantize', str(src), str(tmp_path / 'm.safetensors'), '--rounding', 'mse', '--quiet', '--json']) == 0
    import json
    rep = json.loads(capsys.readouterr().out)
    assert rep['policy']['rounding'] == 'mse' and all(r['rounding'] == 'mse' for r in rep['layers'] if r['format'])
    assert main(['quantize', str(src), str(tmp_path / 'c.safetensors'), '--device', 'cuda', '--quiet']) == (0 if torch.cuda.is_available() else 1)


@pytest.mark.parametrize('fmt,opts', [g for g in GRIDDED if g[0] != 'nvfp4'], ids=lambda v: str(v))
def test_gptq_act_order_writes_a_valid_better_layer(fmt, opts):
    "act order permutes the sweep, never the stored columns: the layer still beats nearest on held-out inputs."
    from cquant.tensor import QuantizedTensor
    spec = cq.get_format(fmt)
    w, cal, held = weight(), inputs(512, 256, 1), inputs(256, 256, 2)
    qt = QuantizedTensor(*gptq_rounding(spec, w, spec.resolve(None, **opts), cal, act_order=True), spec)
    back = cq.load_quantized({**qt.state_dict('m.'), 'm.comfy_quant': cq.encode_json(qt.config)}, 'm.', shape=w.shape,
                             dtype=torch.float32)
    assert torch.equal(back.dequantize(), qt.dequantize(torch.float32))
    assert out_sqnr(w, qt, held) > out_sqnr(w, cq.quantize(w, fmt, **opts), held) + 0.5


def test_calibrated_formats_refuse_stochastic_rounding():
    "A format with its own calibrated encoder names the option instead of the GPTQ message."
    calibrated = [n for n, s in cq.FORMATS.items() if s.declares('calibrated')]
    assert calibrated
    for n in calibrated:
        with pytest.raises(cq.QuantFormatError, match=rf"stochastic_rounding': expected 0 with calibration inputs \({n}'s"):
            cq.quantize(torch.randn(8, 128), n, calibration=torch.randn(32, 128), stochastic_rounding=3)


@pytest.mark.parametrize('fmt,opts', GRIDDED + [('convrot_w4a4', {'convrot_groupsize': 64, 'linear_dtype': 'int8'})],
                         ids=lambda v: str(v))
def test_runtime_inputs_reproduce_the_linear(fmt, opts):
    "A grid's `runtime_inputs` times the basis weight is the format's own linear (the activations GPTQ may model)."
    spec, w, x = cq.get_format(fmt), weight(), inputs(40, 256, 3)
    grid = spec.grid(w, spec.resolve(None, **opts), 1.0)
    if grid.runtime_inputs is None: pytest.skip(f'{fmt} declares no runtime_inputs')
    qt = cq.quantize(w, fmt, **opts)
    ref = torch.nn.functional.linear(x, qt)
    got = grid.runtime_inputs(x) @ grid.basis(qt.dequantize(torch.float32)).T
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize('activations', ('runtime', 'asymmetric', 'noise'))
@pytest.mark.parametrize('fmt,opts', GRIDDED, ids=lambda v: str(v))
def test_gptq_activations_same_tensors_and_errors(fmt, opts, activations):
    w, cal = weight(), inputs(512, 256, 1)
    spec = cq.get_format(fmt); ro = spec.resolve(None, **opts)
    q, p = gptq_rounding(spec, w, ro, cal, 'blk.fc.weight', activations=activations)
    ref = cq.quantize(w, fmt, **opts)
    got = spec.layout.tensors(q, p)
    assert {k: (t.dtype, t.shape) for k, t in got.items()} == \
           {k: (t.dtype, t.shape) for k, t in spec.layout.tensors(ref.qdata, ref.params).items()}
    if spec.grid(w, ro, 1.0).runtime_inputs is None:                 # nothing to model: as 'float', bit for bit
        assert torch.equal(q.view(torch.uint8), gptq_rounding(spec, w, ro, cal, 'blk.fc.weight')[0].view(torch.uint8))
    with pytest.raises(ValueError, match=r"calibration of blk\.fc\.weight.*inputs \[\.\.\., 256\].*shape \(40, 128\)"):
        gptq_rounding(spec, w, ro, torch.randn(40, 128), 'blk.fc.weight', activations=activations)
    with pytest.warns(GPTQWarning, match=r"blk\.fc\.weight: 8 calibration rows"):
        gptq_rounding(spec, w, ro, cal[:8], 'blk.fc.weight', activations=activations)


def test_gptq_activations_option_is_checked():
    spec = cq.get_format('convrot_w4a4'); ro = spec.resolve(None, convrot_groupsize=64)
    with pytest.raises(ValueError, match=r"gptq activations.*expected one of \('float', 'runtime', 'asymmetric', 'noise'\).*'int4'"):
        gptq_rounding(spec, weight(), ro, inputs(64, 256, 1), activations='int4')


def test_gptq_runtime_lowers_the_runtime_error_it_is_fitted_on():
    "In sample, activations='asymmetric' minimises the error of the format's linear: below GPTQ on float inputs."
    w, cal = weight(), inputs(512, 256, 1)
    for fmt, opts in (('convrot_w4a4', {'convrot_groupsize': 64}), ('nvfp4', {})):
        spec = cq.get_format(fmt); ro = spec.resolve(None, **opts)
        err = {}
        for a in ('float', 'asymmetric'):
            q, p = gptq_rounding(spec, w, ro, cal, activations=a)
            qt = cq.QuantizedTensor(q, p, spec)
            err[a] = sqnr(cal @ w.T, torch.nn.functional.linear(cal, qt))
        assert err['asymmetric'] > err['float'] + 0.5, (fmt, err)


def test_sequential_calibration():
    "Calibration(sequential=True): each GPTQ layer rounds on the inputs of the model as quantized so far."
    model, batches = cq.dit_model(0), cq.dit_batches(1, 2, 32, seed=1)
    plan = cq.Policy(mode='int4_full', rounding='gptq').plan(model)
    with pytest.raises(ValueError, match=r"sequential=True .* needs batches"):
        cq.Calibration(cq.collect_inputs(model, batches), sequential=True)
    seq = cq.quantize_model(cq.dit_model(0), plan, calibration=cq.Calibration(batches, sequential=True))
    one = cq.quantize_model(cq.dit_model(0), plan, calibration=batches)
    names = [n for n, d in plan.items() if d.format]
    first, last = names[0], next(n for n in reversed(names) if 'experts' not in n)   # experts: few rows, MSE
    sd, od = seq.state_dict(), one.state_dict()
    assert torch.equal(sd[first + '.weight'], od[first + '.weight'])      # the first layer's inputs are the float ones
    assert not torch.equal(sd[last + '.weight'], od[last + '.weight'])    # later ones see quantized layers before them
    assert {k: (v.dtype, v.shape) for k, v in sd.items()} == {k: (v.dtype, v.shape) for k, v in od.items()}


@pytest.mark.parametrize('mode, extra, at_least', [('int8', (), 41.1), ('int8_convrot', ('--convrot-groupsize', '64'), 42.4)])
def test_exact_rounding_on_minilm_bf16(tmp_path, mode, extra, at_least):
    """rounding='exact' through the CLI on MiniLM's 36 encoder linears in bf16 (issue 40): the mean weight SQNR the
    report states reaches sdnq's int8 (41.13 dB with the same per-row scales) and int8 ConvRot's fp32 bound; kitchen's
    encoder (nearest) stays below. Measured: int8 40.54 -> 41.13 dB, ConvRot group 64 41.63 -> 42.54 dB."""
    import json
    from safetensors.torch import load_file, save_file
    from cquant.minilm import minilm_path
    from conftest import cquant_cli
    src = tmp_path / 'minilm-bf16.safetensors'
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in load_file(minilm_path()).items()}, src)
    mean = {}
    for rounding in ('nearest', 'exact'):
        rc, out, err = cquant_cli('quantize', src, tmp_path / f'{rounding}.safetensors', '--mode', mode, *extra,
                                  '--rounding', rounding, '--report', tmp_path / f'{rounding}.json', '--quiet')
        assert rc == 0, err
        layers = json.loads((tmp_path / f'{rounding}.json').read_text())['layers']
        dbs = [l['sqnr_db'] for l in layers if l['format'] and l['name'].startswith('encoder.')]
        assert len(dbs) == 36
        mean[rounding] = sum(dbs) / len(dbs)
    assert mean['nearest'] < at_least <= mean['exact'], mean
