"""The exploration layer: `cquant.explore` (nbs/20_explore.ipynb: plots, comparison table) and `cquant.explorer`
(nbs/20a_explorer.ipynb: the widget).

Plots are checked through the data they plot (artists' arrays, titles, labels), never through pixels. The explorer
is driven through `set` (as a user changes a control) and its callbacks must run once per change and update
`numbers`. Everything is generic over the format registry: a toy grouped format registered here (a W4A8-like
`group_size` int option and a boolean) must get its controls, its blocks and its grid without any code in
`cquant.explore` or `cquant.explorer` knowing it.
"""
from __future__ import annotations
import math, subprocess, sys, time
from dataclasses import dataclass

import pytest
import torch

import cquant as cq
from cquant.tensor import FORMATS, Format, Layout, Option, Params, Storage, format_error, register, quantize
from cquant.numerics import error_report, from_blocked, representable_values, rotate
from cquant.gguf import ENCODERS, decode_gguf, encode_gguf
from cquant.explore import (Analysis, Comparison, analyze, block_error, block_grid, compare_formats, fit_options,
                            format_color, format_variants, layer_sqnr, normalize_options, option_domain,
                            plot_convrot, plot_error_map, plot_errors, plot_layer_sqnr, plot_sqnr_bars, plot_values,
                            sample_rows, storage_bytes, weight_layers)
from cquant.explorer import Explorer, default_layer, explore, fewest_bits_format

try:
    import comfy_kitchen  # noqa: F401
    HAVE_KITCHEN = True
except ImportError:
    HAVE_KITCHEN = False


# --------------------------------------------------------------------------------------------------------------
# A toy grouped format (int4 codes stored one per int8 byte, one fp32 scale per group of `group_size` columns)
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToyGParams(Params):
    scale: torch.Tensor = None
    group_size: int = 16
    clip: bool = False


class ToyGLayout(Layout):
    Params = ToyGParams

    @classmethod
    def check_shape(cls, shape, opts, prefix=''):
        G, K = opts['group_size'], shape[1]
        if G < 4 or G & (G - 1) or K % G:
            raise format_error(prefix, "comfy_quant['group_size']", f'a power of 2 >= 4 dividing K={K}', G)

    @classmethod
    def quantize(cls, w, stochastic_rounding=0, group_size=16, clip=False):
        N, K = w.shape
        x = w.float().reshape(N, K // group_size, group_size)
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 7 * (0.8 if clip else 1.0)
        q = (x / s).round().clamp(-8, 7).to(torch.int8).reshape(N, K)
        return q, ToyGParams(tuple(w.shape), w.dtype, s.squeeze(-1), group_size, clip)

    @classmethod
    def dequantize(cls, q, p, dtype):
        N, K = p.orig_shape
        return (q.float().reshape(N, K // p.group_size, p.group_size) * p.scale[..., None]).reshape(N, K).to(dtype)

    @classmethod
    def tensors(cls, q, p): return {'weight': q, 'weight_scale': p.scale}


class ToyGrouped(Format):
    "A toy grouped int8 format registered only by the `toy` fixture."
    name, layout, storage = 'toy_grouped', ToyGLayout, Storage(torch.int8, keys=('weight_scale',))
    options = (Option('group_size', 16, int, 'elements per scale'), Option('clip', False, bool, stored=False))


@pytest.fixture
def toy():
    register(ToyGrouped)
    yield ToyGrouped.name
    FORMATS.pop(ToyGrouped.name, None)


def _w(n=128, k=256, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if outlier: w[:, 3] *= 40
    return w


# --------------------------------------------------------------------------------------------------------------
def test_import_cquant_is_light():
    code = ("import sys, cquant, cquant.explore, cquant.explorer; from cquant.explorer import explore; "
            "bad = [m for m in ('matplotlib', 'ipywidgets') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_option_domains_come_from_the_registry(toy):
    assert option_domain(toy, 'group_size', (8, 96)) == [4, 8, 16, 32]
    assert option_domain(toy, 'clip', (8, 96)) == [False, True]
    assert option_domain('int8_tensorwise', 'convrot_groupsize', (8, 384)) == [4, 16, 64]
    assert option_domain('convrot_w4a4', 'linear_dtype', (8, 256)) == ['int4', 'int8']
    assert option_domain('nvfp4', 'scale', (8, 256)) is None                 # a number or tensor: no control
    assert fit_options(toy, (8, 24))['group_size'] == 8                       # 16 does not divide 24
    assert fit_options(toy, (8, 6)) is None
    assert normalize_options('int8_tensorwise', (8, 384))['convrot_groupsize'] == 64
    for name, spec in FORMATS.items():                                        # every offered value fits, any format
        for shape in [(8, 384), (8, 1024), (8, 96), (8, 48)]:
            base = normalize_options(name, shape)
            if base is None: continue
            for o in spec.options:
                for v in option_domain(name, o.name, shape, **base) or []:
                    assert fit_options(name, shape, **{**base, o.name: v}) is not None, (name, o.name, v, shape)


def test_storage_bytes_is_exact_for_every_format(toy):
    g = torch.Generator().manual_seed(1)
    for name in FORMATS:
        for shape in [(1, 64), (300, 128), (700, 64)]:
            o = normalize_options(name, shape)
            if o is None: continue
            x = torch.randn(shape, generator=g)
            full = sum(v.numel() * v.element_size() for v in quantize(x, name, **o).state_dict('').values())
            assert storage_bytes(x, name, **o) == full, (name, shape)


def test_analyze_numbers_and_sampling():
    w = _w(512, 256)
    w[301, 17] = 5.0                                                           # the tensor's largest value
    full = analyze(w, 'int8_tensorwise')
    rep = error_report(w, full.dq)
    assert full.numbers['sqnr_db'] == pytest.approx(rep['sqnr_db'], abs=1e-9)
    assert full.numbers['rel_error'] == pytest.approx(rep['rel_error'], abs=1e-12)
    assert full.numbers['max_abs_error'] == pytest.approx(rep['max_abs_error'], abs=1e-12)
    assert full.numbers['bytes'] == 512 * 256 + 4 and full.numbers['bits_per_weight'] == 8 * (512 * 256 + 4) / (512 * 256)
    s = analyze(w, 'int8_tensorwise', max_elems=64 * 256)
    assert s.sampled and 301 in s.rows.tolist() and len(s.w) == 65
    assert s.row_index(s.amax_row) == 301
    assert torch.equal(s.dq, full.dq[s.rows])                                  # same tensor scale as the full weight
    assert s.numbers['bytes'] == full.numbers['bytes'] and s.numbers['rows_analysed'] == 65
    assert sample_rows(w, None) is None and sample_rows(w, 10 ** 9) is None
    assert isinstance(s, Analysis) and 'rows sampled' in repr(s)


def test_block_grid_matches_the_formats(toy):
    w = _w()
    a = analyze(w, 'int8_tensorwise')
    g = block_grid(a, 5)
    assert g.exact and g.cols == (0, 256) and g.basis == 'weight'
    assert torch.allclose(g.values, torch.arange(-128, 128) * a.qt.params.scale, rtol=0, atol=1e-9)
    a = analyze(w, 'nvfp4')
    g = block_grid(a, 7, 3)
    bs = from_blocked(a.qt.params.block_scale, 128, 16)[7, 3].float() * a.qt.params.global_scale
    assert g.exact and g.cols == (48, 64)
    assert torch.allclose(g.values, representable_values('e2m1').float() * bs, rtol=0, atol=1e-12)
    assert torch.equal(g.x, w[7, 48:64]) and torch.equal(g.xq, a.dq[7, 48:64])
    a = analyze(w, toy, group_size=32)                                        # registered in this test only
    g = block_grid(a, 2, 5)
    assert g.cols == (160, 192) and g.exact
    assert torch.allclose(g.values, torch.arange(-128, 128) * a.qt.params.scale[2, 5], rtol=0, atol=1e-12)
    a = analyze(w, 'int8_tensorwise', convrot=True, convrot_groupsize=16)
    g = block_grid(a, 9)
    assert g.basis == 'rotated (ConvRot 16)' and len(g.values) == 256
    assert torch.allclose(g.values, torch.arange(-128, 128) * a.qt.params.scale[9], rtol=0, atol=1e-6)
    assert torch.allclose(g.x, rotate(w[9], 16))


def test_plot_values_plots_the_grid_and_the_block():
    w = _w()
    a = analyze(w, 'mxfp8')
    fig = plot_values(a, row=4, block=2)
    ax = fig.axes[0]
    g = block_grid(a, 4, 2)
    assert [s[0][0] for s in ax.collections[0].get_segments()] == g.values.tolist()
    assert list(ax.lines[0].get_xdata()) == w[4, 64:96].tolist()
    assert list(ax.lines[1].get_xdata()) == a.dq[4, 64:96].tolist()
    assert ax.get_title() == 'mxfp8 grid at row 4, cols 64–95' and ax.get_yscale() == 'log'
    A = float(g.values.abs().max())
    assert ax.patches[0].get_data().values.sum() == int((w.abs() <= 1.15 * A).sum())
    fig = plot_values(w, 'float8_e4m3fn')                                     # a tensor plus a format works too
    assert len(fig.axes[0].collections[0].get_segments()) == 253
    assert 'one scale per row or tensor' in fig.axes[0].get_title()
    with pytest.raises(ValueError, match='needs a format'): plot_values(w)


def test_plot_errors_and_error_map(toy):
    w = _w()
    a = analyze(w, 'nvfp4')
    fig = plot_errors(a)
    ax = fig.axes[0]
    assert ax.patches[0].get_data().values.sum() == w.numel()
    assert ax.get_title() == f"nvfp4: SQNR {a.numbers['sqnr_db']:.2f} dB, rel. error {a.numbers['rel_error']:.4f}"
    for fmt, opts, B in [('nvfp4', {}, 16), ('mxfp8', {}, 32), (toy, {'group_size': 64}, 64), ('int8_tensorwise', {}, 64)]:
        a = analyze(w, fmt, **opts)
        fig = plot_error_map(a)
        img = torch.tensor(fig.axes[0].images[0].get_array().filled(math.nan))
        assert img.shape == (128, 256 // B), fmt
        assert torch.allclose(img, block_error(w, a.dq, B), rtol=0, atol=1e-12)
        rows = torch.tensor(fig.axes[1].lines[0].get_xdata())
        assert torch.allclose(rows, (a.dq.double() - w.double()).square().mean(1).sqrt(), rtol=0, atol=1e-12)
        assert ("the format's blocks" in fig.axes[0].get_title()) == (fmt != 'int8_tensorwise')
    a = analyze(w, 'nvfp4')
    fig = plot_error_map(a, metric='sqnr')
    sq = torch.tensor(fig.axes[1].lines[0].get_xdata())
    assert torch.allclose(sq, torch.tensor([error_report(w[i], a.dq[i])['sqnr_db'] for i in range(128)], dtype=torch.float64), rtol=0, atol=1e-9)
    assert fig.axes[0].get_title() == 'nvfp4: SQNR (dB) per block of 16 (the format\'s blocks)'
    big = analyze(_w(4096, 64), 'nvfp4', max_elems=64 * 64)
    fig = plot_error_map(big)
    assert fig.axes[0].get_ylabel() == 'row (sampled)'
    assert any('of 4096 rows sampled' in t.get_text() for t in fig.texts)


def test_compare_formats_table():
    w = _w(128, 384)
    rows = compare_formats(w, expand=True)
    assert isinstance(rows, Comparison) and all(isinstance(r, dict) for r in rows)
    variants, skipped = format_variants((128, 384), expand=True)
    assert [r['label'] for r in rows] == [v[0] for v in variants]
    assert {v[1] for v in variants} | set(skipped) == set(FORMATS)
    by = {r['label']: r for r in rows}
    assert by['int8_tensorwise[convrot,convrot_groupsize=64]']['options'] == {'convrot': True, 'convrot_groupsize': 64}
    for r in rows:
        a = analyze(w, r['format'], **r['options'])
        assert r['sqnr_db'] == pytest.approx(a.numbers['sqnr_db'], abs=1e-9)
        assert r['bytes'] == a.numbers['bytes'] and r['quantize_s'] > 0
        if HAVE_KITCHEN and r['format'] in ('float8_e4m3fn', 'float8_e5m2', 'nvfp4', 'mxfp8', 'int8_tensorwise', 'convrot_w4a4'):
            assert r['kitchen_same'] is True and r['kitchen_bytes'] == r['bytes'], r['label']
            assert r['kitchen_sqnr_db'] == pytest.approx(r['sqnr_db'], abs=1e-9)
    text, md = rows.table(), rows.table(markdown=True)
    assert all(r['label'] in text and r['label'] in md for r in rows)
    assert md.startswith('| variant | SQNR dB |') and str(rows) == text
    narrow = compare_formats(_w(16, 96), kitchen=False)
    assert 'convrot_w4a4' in narrow.skipped and 'K % 64 == 0' in narrow.skipped['convrot_w4a4']
    assert 'not applicable: convrot_w4a4' in narrow.table() and 'kitchen_bytes' not in narrow[0]
    sampled = compare_formats(_w(1024, 64), formats=['nvfp4', ('int8 rows', 'int8_tensorwise', {'per_row': True})], kitchen=False, max_elems=4096)
    assert [r['label'] for r in sampled] == ['nvfp4', 'int8 rows'] and sampled[0]['sampled']
    assert sampled[0]['bytes'] == storage_bytes(_w(1024, 64), 'nvfp4')


def test_plot_sqnr_bars():
    rows = compare_formats(_w(64, 256), kitchen=False)
    fig = plot_sqnr_bars(rows, title='t')
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [r['sqnr_db'] for r in rows]
    assert [t.get_text() for t in ax.get_xticklabels()] == [r['label'] for r in rows]
    from matplotlib.colors import to_rgba
    assert [p.get_facecolor() for p in ax.patches] == [to_rgba(format_color(r['format'])) for r in rows]
    assert ax.get_title() == 't' and [t.get_text() for t in ax.texts] == [f"{r['bits_per_weight']:.2f} b/w" for r in rows]


def test_plot_convrot():
    w = _w(64, 256, outlier=False)
    w[:, 37] *= 60
    fig = plot_convrot(w, group=64)
    a0, a1, a2 = fig.axes
    r = int(w[:, 37].abs().argmax())
    assert list(a0.lines[0].get_ydata()) == w[r].abs().tolist()
    assert torch.allclose(torch.tensor(a0.lines[1].get_ydata()), rotate(w, 64)[r].abs())
    assert a0.get_title().startswith(f'row {r}: channel 37 ')
    before, after = torch.tensor(a2.lines[0].get_ydata()), torch.tensor(a2.lines[1].get_ydata())
    assert after.mean() > before.mean() + 5
    assert len(a1.collections[0].get_segments()) == 15                       # the 15 int4 levels
    with pytest.raises(ValueError, match='no ConvRot group'): plot_convrot(torch.randn(4, 6))


def test_layer_sqnr_plan_reference_and_plot(tmp_path):
    g = torch.Generator().manual_seed(3)
    sd = {f'b{i}.{n}.weight': torch.randn(64, 128, generator=g) * 0.02 for i in range(2) for n in ('q', 'mlp')}
    sd['head.weight'] = torch.randn(8, 128, generator=g)
    sd['head.bias'] = torch.zeros(8)
    sd['norm.weight'] = torch.ones(128)
    plan = {'b0.q': 'nvfp4', 'b0.mlp': ('int8_tensorwise', {'per_row': True}), 'b1.q': 'mxfp8', 'b1.mlp.weight': 'float8_e4m3fn', 'head': None}
    rows = layer_sqnr(sd, plan)
    assert [r['layer'] for r in rows] == ['b0.q', 'b0.mlp', 'b1.q', 'b1.mlp', 'head']
    assert [r['format'] for r in rows] == ['nvfp4', 'int8_tensorwise', 'mxfp8', 'float8_e4m3fn', None]
    for r in rows[:4]:
        a = analyze(sd[r['layer'] + '.weight'], r['format'], **r['options'])
        assert r['sqnr_db'] == pytest.approx(a.numbers['sqnr_db'], abs=1e-9) and r['bits_per_weight'] == a.numbers['bits_per_weight']
    assert rows[4]['sqnr_db'] == math.inf and rows[4]['bits_per_weight'] == 32.0
    path = tmp_path / 'q.safetensors'
    qsd = {k: v for k, v in sd.items() if not k.endswith('weight') or k[:-7] not in [r['layer'] for r in rows[:4]]}
    for r in rows[:4]: qsd[r['layer'] + '.weight'] = quantize(sd[r['layer'] + '.weight'], r['format'], **r['options'])
    cq.save_file(qsd, path)
    back = {r['layer']: r for r in layer_sqnr(path, reference=sd)}
    for r in rows[:4]:
        assert back[r['layer']]['sqnr_db'] == pytest.approx(r['sqnr_db'], abs=1e-9)
        assert back[r['layer']]['bits_per_weight'] == pytest.approx(r['bits_per_weight'])
    assert back['head']['format'] is None
    refs = weight_layers(path)
    assert refs['b0.q'].format == 'nvfp4' and refs['head'].format is None and 'norm' not in refs
    fig = plot_layer_sqnr(rows, title='x')
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches][:4] == [r['sqnr_db'] for r in rows[:4]] and math.isnan(ax.patches[4].get_height())
    assert [t.get_text() for t in ax.get_xticklabels()] == ['b0.q', 'b0.mlp', 'b1.q', 'b1.mlp', 'head']
    assert len(ax.collections[0].get_offsets()) == 1                           # one float layer, marked at the top
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [f"{r['format']} ({r['bits_per_weight']:.2f} b/w)" for r in rows[:4]] + ['float (kept float, ▼)']
    from matplotlib.colors import to_rgba
    assert [p.get_facecolor() for p in ax.patches][:4] == [to_rgba(format_color(r['format'])) for r in rows[:4]]
    by_label = plot_layer_sqnr([dict(r, label=l) for r, l in zip(rows, ['A', 'B', 'A', 'B', 'float'])], by='label').axes[0]
    assert [p.get_facecolor() for p in by_label.patches][:4] == [to_rgba(c) for c in ('C0', 'C1', 'C0', 'C1')]
    assert [t.get_text() for t in by_label.get_legend().get_texts()][2] == 'float (kept float, ▼)'
    with pytest.raises(ValueError, match='give a plan'): layer_sqnr(sd)


@pytest.mark.filterwarnings('ignore::UserWarning')   # the policy's "no architecture recognised" note
def test_layer_sqnr_takes_a_policy():
    policy = pytest.importorskip('cquant.policy')
    g = torch.Generator().manual_seed(4)
    sd = {f'blocks.{i}.attn.qkv.weight': torch.randn(192, 256, generator=g) * 0.02 for i in range(2)}
    p = policy.Policy(mode='int8')
    rows = layer_sqnr(sd, p)
    plan = p.plan(sd)
    assert [r['format'] for r in rows] == [plan[r['layer']].format for r in rows]
    assert all(r['label'] == plan[r['layer']].label for r in rows)


def test_explorer_callbacks_update_numbers(toy):
    sd = {'a.weight': _w(64, 256, 1), 'b.weight': _w(32, 96, 2, outlier=False)}
    ex = explore(sd, format='int8_tensorwise')
    assert isinstance(ex, Explorer) and ex.updates == 1 and ex.calls == {}
    assert ex.numbers['sqnr_db'] == pytest.approx(analyze(sd['a.weight'], 'int8_tensorwise').numbers['sqnr_db'], abs=1e-9)
    assert [n for n in ex.controls][:4] == ['layer', 'format', 'row', 'block']
    assert ex.controls['convrot_groupsize'].options == (('4', 4), ('16', 16), ('64', 64), ('256', 256))
    steps = [('per_row', True), ('convrot', True), ('convrot_groupsize', 16), ('row', 3), ('format', 'nvfp4'), ('block', 2),
             ('format', toy), ('group_size', 64), ('clip', True), ('layer', 'b')]
    for i, (name, value) in enumerate(steps, start=2):
        before = dict(ex.calls)
        ex.set(name, value)
        assert ex.updates == i, name                                          # exactly one callback per change
        assert ex.calls[name] == before.get(name, 0) + 1
        assert sum(ex.calls.values()) == sum(before.values()) + 1
        assert ex.numbers['error'] is None, ex.numbers['error']
        opts = {k: v for k, v in ex.options.items()}
        want = analyze(sd[ex.layer + '.weight'], ex.format, **opts).numbers
        assert ex.numbers['sqnr_db'] == pytest.approx(want['sqnr_db'], abs=1e-9), name
        assert ex.numbers['bytes'] == want['bytes'] and ex.numbers['bits_per_weight'] == want['bits_per_weight']
        if name == 'convrot_groupsize': assert ex.numbers['options'] == {'per_row': True, 'convrot': True, 'convrot_groupsize': 16}
        if name == 'row': assert ex.numbers['row'] == 3
        if name == 'block': assert ex.numbers['block'] == 2 and ex.grid.cols == (32, 48)
        if name == 'format' and value == toy:
            assert [n for n in ex.controls][4:] == ['group_size', 'clip']
            assert [v for _, v in ex.controls['group_size'].options] == [4, 8, 16, 32, 64, 128, 256]
        if name == 'group_size': assert ex.controls['block'].max == 256 // 64 - 1 and ex.analysis.block == 64
        if name == 'layer':
            assert ex.numbers['layer'] == 'b' and ex.numbers['shape'] == (32, 96)
            assert [v for _, v in ex.controls['group_size'].options] == [4, 8, 16, 32]   # re-derived for K = 96
            assert ex.options['group_size'] == 32 and ex.options['clip'] is True
    n = ex.updates
    from traitlets import TraitError
    with pytest.raises(TraitError): ex.set('group_size', 12)                 # not offered: refused, no callback
    with pytest.raises(KeyError): ex.set('nonsense', 1)
    assert ex.updates == n
    assert ex.figure is ex.figure and len(ex.figure.axes) == 5               # drawn once, on demand
    assert ex.figure.axes[0].get_title().startswith('toy_grouped grid at row')
    assert ex.figure.get_suptitle().startswith('b 32x96 → toy_grouped[group_size=32,clip]: SQNR')


def test_explorer_sources(tmp_path):
    w = _w(64, 256)
    ex = explore(w)
    assert list(ex.layers) == ['weight'] and ex.numbers['format'] == fewest_bits_format((64, 256))
    path = tmp_path / 'm.safetensors'
    cq.save_file({'x.weight': w, 'y.weight': cq.quantize(w, 'nvfp4')}, path)
    ex = explore(str(path), layer='y')
    assert ex.layers['y'].format == 'nvfp4' and ex.numbers['layer'] == 'y'
    assert '[nvfp4]' in ex.controls['layer'].options[1][0]
    with pytest.raises(ValueError, match='no 2-D'): explore({'b': torch.zeros(3)})


def test_explorer_is_responsive_on_4096():
    big = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16) * 0.02
    t0 = time.perf_counter()
    ex = explore(big, format='nvfp4')
    ex.set('format', 'mxfp8')
    dt = time.perf_counter() - t0
    assert ex.numbers['sampled'] and ex.numbers['rows_analysed'] in (256, 257)
    assert ex.numbers['bytes'] == 4096 * 4096 + 4096 * 128                  # the whole layer's bytes, not the sample's
    assert dt < 30, dt
    assert any('of 4096 rows sampled' in t.get_text() for t in ex.figure.texts)


# --------------------------------------------------------------------------------------------------------------
# The explorer in a real JupyterLab: the widget alone shows the figure, laid out at its displayed size
# --------------------------------------------------------------------------------------------------------------
def _png(data: bytes):
    import io
    import numpy as np
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(data)).convert('RGB'))


def _full_render(fig):
    "The figure drawn from scratch, as the image should show it."
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format='png', dpi=fig.dpi)
    return _png(buf.getvalue())


def _tree(w):
    yield w
    for c in getattr(w, 'children', ()): yield from _tree(c)


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _tick_boxes(ax, fig):
    r = fig.canvas.get_renderer()
    lo, hi = sorted(ax.get_xlim())
    return [t.get_window_extent(r) for t, v in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= v <= hi and t.get_text()]


def test_the_widget_alone_shows_the_figure_and_updates_it():
    sd = {'a.weight': _w(64, 256, 1), 'b.weight': _w(32, 96, 2, outlier=False)}
    ex = explore(sd, format='nvfp4', width=800, height=520)
    tree = list(_tree(ex.widget))
    assert ex.image in tree and ex.row_text in tree and ex.controls['row'] in tree
    assert ex.image.layout.width == '800px'
    first = _png(ex.image.value)
    assert first.shape == (520, 800, 3)                                        # drawn on creation, at the displayed size
    assert (first == _full_render(ex.figure)).all()
    children = [list(getattr(w, 'children', ())) for w in tree]
    for name, value in [('row', 9), ('block', 3), ('format', 'int8_tensorwise'), ('per_row', True), ('row', 40), ('layer', 'b')]:
        before = ex.image.value
        ex.set(name, value)
        assert ex.image.value != before, name                                 # every change redraws the image ...
        assert (_png(ex.image.value) == _full_render(ex.figure)).all(), name  # ... exactly as a full redraw would
        assert ex.figure.axes[0].get_title().startswith(f"{ex.format} grid at row {ex.numbers['row']}"), name
        r = ex.figure.canvas.get_renderer()
        assert not _overlap(*(ax.title.get_window_extent(r) for ax in ex.figure.axes[:2])), name   # titles side by side
    assert [list(getattr(w, 'children', ())) for w in tree[:3]] == children[:3]   # the tree is not rebuilt
    assert ex.widget.children[-1] is ex.image and len(ex.figure.axes) == 5


def test_controls_line_up():
    ex = explore({'a.weight': _w(64, 256, 1)}, format='int8_tensorwise')
    widths = {n: c.style.description_width for n, c in ex.controls.items()}
    assert len(set(widths.values())) == 1 and len(widths) == 7, widths        # options and the others alike
    col = ex.controls['format'].layout.width
    assert all(ex.controls[n].layout.width == col for n in ('per_row', 'convrot', 'convrot_groupsize', 'block'))


def test_row_control_counts_rows_of_the_full_weight():
    big = _w(4096, 64, 7, outlier=False)
    ex = explore(big, format='nvfp4', max_elems=64 * 64)
    rows = ex.analysis.rows.tolist()
    assert ex.analysis.sampled and ex.controls['row'].max == ex.row_text.max == 4095
    for target in (1000, 2999, 4095, 1):
        n = ex.calls.get('row', 0)
        ex.row_text.value = target                                             # an exact row typed in the box
        want = min(rows, key=lambda r: (abs(r - target), r))
        assert ex.calls['row'] == n + 1                                        # one callback, not one per linked widget
        assert ex.controls['row'].value == ex.row_text.value == ex.numbers['row'] == want
        assert ex.figure.axes[0].get_title().startswith(f'nvfp4 grid at row {want}, ')
        assert torch.equal(ex.grid.x, big[want, ex.grid.cols[0]:ex.grid.cols[1]])
    small = explore(_w(300, 64), format='nvfp4')
    small.row_text.value = 217
    assert small.controls['row'].value == small.numbers['row'] == 217 and small.grid.row == 217


def test_layout_nothing_overlaps():
    import numpy as np
    big = _w(4096, 256, 8)
    ex = explore(big, format='nvfp4', max_elems=64 * 256)
    fig = ex.figure
    r = fig.canvas.get_renderer()
    values, errors, emap, rows, cbar = fig.axes
    for ax in (rows, errors):                                                  # tick labels that do not run together
        boxes = _tick_boxes(ax, fig)
        assert len(boxes) >= 2 and not any(_overlap(a, b) for a, b in zip(boxes, boxes[1:])), ax.get_title()
    note = fig._suptitle
    assert 'of 4096 rows sampled' in note.get_text()
    assert not any(_overlap(note.get_window_extent(r), ax.get_tightbbox(r)) for ax in fig.axes)   # its own line
    leg = values.get_legend().get_window_extent(r)                              # the legend above the bars
    counts, edges, _ = values.patches[0].get_data()
    x = (edges[:-1] + edges[1:]) / 2
    top = values.transData.transform(np.c_[x, np.maximum(counts, 0.5)])
    under = (top[:, 0] > leg.x0) & (top[:, 0] < leg.x1)
    assert under.any() and (top[under, 1] < leg.y0).all()
    m = plot_error_map(analyze(big, 'nvfp4', max_elems=64 * 256))             # a plot's own figure: the note clear too
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(m).draw()
    r = m.canvas.get_renderer()
    assert not any(_overlap(m._suptitle.get_window_extent(r), ax.get_tightbbox(r)) for ax in m.axes)
    boxes = _tick_boxes(m.axes[1], m)
    assert not any(_overlap(a, b) for a, b in zip(boxes, boxes[1:]))


def test_defaults_pick_an_interesting_layer_and_a_lossy_format():
    g = torch.Generator().manual_seed(9)
    sd = {'embed_tokens.weight': torch.randn(1000, 128, generator=g), 'pos_embed.weight': torch.randn(64, 128, generator=g),
          'blocks.0.attn.qkv.weight': torch.randn(384, 128, generator=g) * 0.02, 'blocks.0.mlp.fc1.weight': torch.randn(512, 128, generator=g),
          'final_layer.linear.weight': torch.randn(16, 128, generator=g)}
    assert default_layer(weight_layers(sd)) == 'blocks.0.attn.qkv'
    assert default_layer(weight_layers({'pos_embed.weight': sd['pos_embed.weight']})) == 'pos_embed'   # nothing else: the first
    probe = torch.randn(128, 384, generator=g)
    bits = {n: analyze(probe, n).numbers['bits_per_weight'] for n in FORMATS if normalize_options(n, (128, 384)) is not None}
    assert fewest_bits_format((4096, 384)) == min(bits, key=bits.get)
    assert fewest_bits_format((8, 384), names=['mxfp8', 'int8_tensorwise']) == min(['mxfp8', 'int8_tensorwise'], key=bits.get)
    assert fewest_bits_format((8, 96), names=['convrot_w4a4']) is None                 # K % 64 != 0
    ex = explore(sd)
    assert ex.layer == 'blocks.0.attn.qkv' and ex.format == min(bits, key=bits.get) and ex.numbers['bits_per_weight'] < 5


def test_minilm_opens_on_a_linear_layer():
    from cquant.minilm import minilm_path
    try: path = minilm_path()
    except Exception as e: pytest.skip(f'MiniLM weights not installed: {e}')
    ex = explore(str(path))
    assert ex.layer.startswith('encoder.layer.0.') and 'embeddings' not in ex.layer
    assert ex.numbers['bits_per_weight'] < 5 and ex.numbers['sqnr_db'] < 25


def test_kitchen_numbers_for_formats_kitchen_only_loads():
    "AWQ and SVDQuant: kitchen's layouts refuse to quantize; the explorer says so instead of a raw error."
    from cquant.explore import analyze, kitchen_numbers
    pytest.importorskip('comfy_kitchen')
    w = torch.randn(64, 128)
    for f in ('awq_w4a16', 'svdquant_w4a4'):
        assert kitchen_numbers(analyze(w, f)) == {
            'kitchen_error': f"comfy-kitchen does not quantize {f} (offline calibration); it loads cquant's files"}
    assert kitchen_numbers(analyze(w, 'nvfp4'))['kitchen_same'] is True


def test_explorer_lists_gguf_types():
    "GGUF's types sit in the format list where the layer's rows fill their blocks; chosen, they have no options and no code grid."
    w = _w(128, 512)
    ex = explore({'a.weight': w, 'b.weight': _w(64, 96, 2)}, layer='a', format='GGUF Q5_K')
    assert [f for f in ex.controls['format'].options if f.startswith('GGUF')] == [f'GGUF {t}' for t in ENCODERS]
    assert ex.error is None and ex.numbers['label'] == 'GGUF Q5_K' and ex.numbers['bits_per_weight'] == 5.5
    assert ex.options == {} and set(ex.controls) == {'layer', 'format', 'row', 'block'} and ex.grid.values is None
    want = 10 * math.log10(w.float().pow(2).sum() / (decode_gguf(encode_gguf(w, 'Q5_K').reshape(-1), 'Q5_K', (128, 512)) - w.float()).pow(2).sum())
    assert abs(ex.numbers['sqnr_db'] - want) < 1e-6
    ex.set('format', 'nvfp4')
    assert ex.numbers['label'] == 'nvfp4' and ex.grid.values is not None
    assert {r['label'] for r in ex.comparison} >= {'nvfp4', 'GGUF Q8_0', 'GGUF Q4_K'}
    ex.set('layer', 'b')                                                    # K = 96: no K-quant fits, the legacy 32-blocks do
    assert [f for f in ex.controls['format'].options if f.startswith('GGUF')] == ['GGUF Q8_0', 'GGUF Q4_0', 'GGUF Q4_1', 'GGUF Q5_0', 'GGUF Q5_1']
