"""Calibration: hooks removed (also on errors), streaming statistics independent of batching, scales survive
save/load through QuantLinear + cq.save_file/load_file + load_quantized_model, the smoothing identity."""
import warnings

import pytest
import torch
import torch.nn as nn

import cquant as cq
from cquant.calibrate import (CalibrationWarning, apply_input_scales, calibrate, collect_amax, input_scale_rule,
                              search_smoothing, smooth_scales, smoothing_identity_error)
from cquant.modules import QuantLinear, load_quantized_model, quantize_model


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)
        with torch.no_grad():
            for p in self.parameters(): p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    def forward(self, x): return self.b(torch.relu(self.a(x)))


def _batches(n=3, scale=100.):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 32, generator=g) * scale for _ in range(n)]


def _no_hooks(m): return all(not mod._forward_pre_hooks and not mod._forward_hooks for mod in m.modules())


def test_hooks_removed():
    m = Tiny()
    calibrate(m, _batches())
    assert _no_hooks(m)


def test_hooks_removed_on_exception():
    m = Tiny()
    def bad():
        yield torch.randn(4, 32)
        raise RuntimeError('boom')
    with pytest.raises(RuntimeError, match='boom'): calibrate(m, bad())
    assert _no_hooks(m)
    with pytest.raises(ValueError, match='non-finite'): calibrate(m, [torch.full((2, 32), float('nan'))])
    assert _no_hooks(m)


def test_one_by_one_equals_concatenated():
    m, bs = Tiny(), _batches(5)
    one = collect_amax(m, bs)
    cat = collect_amax(m, [torch.cat(bs)])
    assert one.keys() == cat.keys() == {'a', 'b'}
    for k in one: assert cq.same_bits(one[k], cat[k]), k
    assert one['a'] == torch.cat(bs).abs().amax()
    s1, s2 = calibrate(m, bs), calibrate(m, [torch.cat(bs)])
    for f in s1:
        for k in s1[f]: assert cq.same_bits(s1[f][k], s2[f][k])


def test_formulas_and_dynamic_formats():
    m, bs = Tiny(), _batches()
    amax = torch.cat(bs).abs().amax()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        s = calibrate(m, bs, ['float8_e4m3fn', 'nvfp4', 'mxfp8', 'int8_tensorwise'])
    assert sorted(s) == ['float8_e4m3fn', 'nvfp4']
    assert sum(issubclass(x.category, CalibrationWarning) for x in w) == 2
    assert float(s['float8_e4m3fn']['a']) == pytest.approx(float(amax) / 448, rel=1e-6)
    assert float(s['nvfp4']['a']) == pytest.approx(float(amax) / 2688, rel=1e-6)
    assert input_scale_rule('mxfp8') is None and input_scale_rule('w6a8_int8') is None
    p2 = calibrate(m, bs, 'float8_e4m3fn', pow2=True)['float8_e4m3fn']['a']
    assert float(p2) == 2.0 ** torch.ceil(torch.log2(amax / 448)).item()
    # a plan: only layers whose format takes input_scale
    with pytest.warns(CalibrationWarning, match='int8_tensorwise'): sp = calibrate(m, bs, {'a': 'float8_e4m3fn', 'b': 'int8_tensorwise'})
    assert list(sp) == ['a']


def test_scales_survive_save_load(tmp_path):
    m, bs = Tiny(), _batches(scale=1000.)               # inputs far above 448: scale 1.0 would clip
    plan = {'a': 'float8_e4m3fn', 'b': 'nvfp4'}
    scales = calibrate(m, bs, plan)
    quantize_model(m, plan)
    apply_input_scales(m, scales)
    assert isinstance(m.a, QuantLinear) and cq.same_bits(m.a.input_scale, scales['a'])
    x = bs[0]
    y = m(x)
    sd = m.state_dict()
    assert cq.same_bits(sd['a.input_scale'], scales['a']) and cq.same_bits(sd['b.input_scale'], scales['b'])
    cq.save_file(sd, tmp_path / 'm.safetensors')
    back = cq.load_file(tmp_path / 'm.safetensors')
    m2 = Tiny()
    load_quantized_model(m2, back)
    assert cq.same_bits(m2.a.input_scale, scales['a']) and cq.same_bits(m2.b.input_scale, scales['b'])
    assert cq.same_bits(m2(x), y)
    # calibrated beats ComfyUI's default 1.0 when activations exceed 448
    ref = Tiny().a(x)
    m.a.input_scale = None
    err1 = (m.a(x) - ref).square().sum()
    m.a.input_scale = scales['a']
    errc = (m.a(x) - ref).square().sum()
    assert errc < err1 / 100


def test_apply_input_scales_rejects():
    m = Tiny()
    quantize_model(m, {'a': 'int8_tensorwise'})
    with pytest.raises(ValueError, match='no input_scale'): apply_input_scales(m, {'a': 1.0})
    with pytest.raises(TypeError): apply_input_scales(m, {'b': 1.0})


def test_smoothing_identity():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-1, 2, 128)
    w = torch.randn(96, 128, generator=g)
    for a in (0.0, 0.25, 0.5, 0.75, 1.0):
        p = 1 / smooth_scales(x.abs().amax(0), w.abs().amax(0), a)
        assert smoothing_identity_error(x, w, p) < 1e-6
        torch.testing.assert_close((x * p) @ (w / p).T, x @ w.T, rtol=1e-4, atol=1e-3)
    assert torch.equal(smooth_scales(torch.tensor([4., 1., 0.]), torch.tensor([1., 4., 2.]), 0.5), torch.tensor([2., 0.5, 1.]))


def test_search_smoothing_with_outliers_and_file():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=g)
    x[:, [3, 40]] *= 50                                  # activation outlier channels
    w = torch.randn(32, 64, generator=g) * 0.1
    r = search_smoothing(w, [x[:128], x[128:]])
    assert r['alpha'] is not None and r['sqnr'] > r['sqnr_none'] + 1
    lin = nn.Linear(64, 32, bias=False)
    with torch.no_grad(): lin.weight.copy_(w / r['pre_quant_scale'])
    q = QuantLinear.from_float(lin, 'nvfp4')
    q.pre_quant_scale, q.input_scale = r['pre_quant_scale'], r['input_scale']
    y = q(x)
    assert cq.sqnr(x @ w.T, y) == pytest.approx(r['sqnr'], abs=1e-6)
