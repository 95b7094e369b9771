"""rounding='mse' and 'gptq' for asym_w4a8_int8 / w6a8_int8: the grid (`w4a8_grid`), the files it writes, the gains
over the encoder, the refusal of the asymmetric variant, and kitchen's decoder on GPTQ-rounded tensors."""
import pytest
import torch
import torch.nn.functional as F
import cquant as cq
from cquant.tensor import FORMATS, QuantizedTensor, QuantFormatError, check_values, encode_json, load_quantized
from cquant.tensor import test_bits as assert_bits          # alias: pytest would collect test_bits
from cquant.numerics import sqnr
from cquant.w4a8 import w4a8_int8_grid, w4a8_levels

try: import comfy_kitchen as ck
except ImportError: ck = None   # pragma: no cover

_TABLE = torch.tensor([-1.0, -0.8, -0.62, -0.47, -0.35, -0.24, -0.14, -0.05,
                       0.04, 0.13, 0.23, 0.34, 0.46, 0.6, 0.78, 0.95])
VARIANTS = [('asym_w4a8_int8', {}), ('asym_w4a8_int8', {'codebook': False, 'group_size': 32}),
            ('asym_w4a8_int8', {'codebook': _TABLE, 'convrot_groupsize': 64}),
            ('asym_w4a8_int8', {'group_size': 8, 'scale_search': False}),
            ('w6a8_int8', {}), ('w6a8_int8', {'group_size': 32, 'convrot_groupsize': 16})]
IDS = [f"{f}-{'-'.join(k for k in o) or 'default'}" for f, o in VARIANTS]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def weight(N=64, K=512, dtype=torch.float32, seed=0):
    "A heavy-tailed weight with outlier columns and rows of different magnitude."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * (0.2 + torch.rand(N, 1, generator=g)) * 0.02
    w[:, 7] *= 20
    w[torch.randint(0, N, (30,), generator=g), torch.randint(0, K, (30,), generator=g)] *= 10
    return w.to(dtype)


def inputs(M, K, seed):
    "Correlated activations (a shared low-rank part plus outlier channels), like a real layer's."
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(16, K, generator=torch.Generator().manual_seed(99))
    x = torch.randn(M, 16, generator=g) @ mix + 0.3 * torch.randn(M, K, generator=g)
    x[:, :4] *= 8
    return x


def search_free(spec, w, opts):
    "The grid at clip 1 and every group's scale without a search: (grid, basis weight, scales)."
    grid = spec.grid(w, spec.resolve(None, **opts), 1.0)
    wb = grid.basis(w)
    one = torch.ones(wb.shape[0], 1)
    return grid, wb, [grid.scale(wb[:, a:b], one) for a, b in grid.slices(wb.shape[1])]


def same_tensors(qt, ref):
    "The state dicts have the same keys, dtypes and shapes."
    a, b = qt.state_dict('m.'), ref.state_dict('m.')
    assert sorted(a) == sorted(b)
    for k in a: assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k


def reload(qt, dtype):
    "`qt` saved with its comfy_quant and loaded back; the stored tensors come back bit for bit."
    sd = {**qt.state_dict('blk.fc.'), 'blk.fc.comfy_quant': encode_json(qt.config)}
    back = load_quantized(sd, 'blk.fc.', shape=tuple(qt.shape), dtype=dtype)
    for k, v in back.state_dict('blk.fc.').items(): assert_bits(v, sd[k], k)
    spec = FORMATS[qt.format]
    check_values(spec, spec.layout.tensors(back.qdata, back.params), 'blk.fc.')
    return back


@pytest.mark.parametrize('fmt,opts', VARIANTS, ids=IDS)
@pytest.mark.parametrize('dtype', DTYPES)
def test_clip1_scales_pack_the_encoders_file(fmt, opts, dtype):
    spec, w = FORMATS[fmt], weight(dtype=dtype)
    grid, wb, scales = search_free(spec, w, opts)
    qt = QuantizedTensor(*grid.pack(wb, scales), spec)
    ref = cq.quantize(w, fmt, **opts)
    same_tensors(qt, ref)
    back = reload(qt, dtype)
    assert_bits(back.dequantize(), qt.dequantize())
    assert_bits(qt.params.s_channel, ref.params.s_channel)           # the row scales are the encoder's
    if dtype != torch.bfloat16:   # the encoder rotates bf16 weights in bf16, the grid in fp32: some groups differ
        same = (qt.params.s_rel.view(torch.uint8) == ref.params.s_rel.view(torch.uint8)).float().mean()
        assert same > 0.99, float(same)
    assert abs(sqnr(w.float(), qt.dequantize(torch.float32)) - sqnr(w.float(), ref.dequantize(torch.float32))) < 0.05


@pytest.mark.parametrize('fmt,opts', VARIANTS, ids=IDS)
def test_nearest_is_the_nearest_grid_value_and_pack_keeps_it(fmt, opts):
    spec, w = FORMATS[fmt], weight(seed=1)
    grid, wb, scales = search_free(spec, w, opts)
    p0 = cq.quantize(w, fmt, **opts).params
    cb = p0.codebook if isinstance(p0.codebook, torch.Tensor) else None
    levels = w4a8_levels(p0.bits, cb) if cb is not None else w4a8_levels(p0.bits)[1:]   # uniform: code 0 unused
    t = wb + 0.3 * torch.randn(wb.shape, generator=torch.Generator().manual_seed(2))   # off the grid
    v = torch.cat([grid.nearest(t[:, a:b], s) for (a, b), s in zip(grid.slices(t.shape[1]), scales)], 1)
    for (a, b), s in zip(grid.slices(t.shape[1]), scales):
        cand = (levels[None, :] * s).round().clamp(-127, 127)                           # [N, L]: the group's grid
        best = (t[:, a:b, None] - cand[:, None, :]).abs().amin(-1)
        assert torch.equal((t[:, a:b] - v[:, a:b]).abs(), best)
    a, b = grid.slices(t.shape[1])[0]
    assert torch.equal(grid.nearest(t[:, a:b].t().contiguous().t(), scales[0]), v[:, a:b])   # any memory layout
    q, p = grid.pack(v, scales)                                                          # values on the grid: kept
    assert torch.equal(w4a8_int8_grid(q, p.s_rel, p.bits, cb, p.group_size).float(), v)


def test_basis_and_inputs_give_the_layer_up_to_the_row_scale():
    spec, w = FORMATS['asym_w4a8_int8'], weight()
    grid = spec.grid(w, spec.resolve(None), 1.0)
    x = inputs(32, 512, 3)
    y = (grid.inputs(x).double() @ grid.basis(w).double().T) * cq.quantize(w, spec.name).params.s_channel.double()
    ref = x.double() @ w.double().T
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize('fmt,opts', VARIANTS, ids=IDS)
@pytest.mark.parametrize('dtype', (torch.float32, torch.bfloat16))
def test_mse_files_and_never_worse(fmt, opts, dtype):
    w = weight(dtype=dtype, seed=4)
    ref, qt = cq.quantize(w, fmt, **opts), cq.quantize(w, fmt, rounding='mse', **opts)
    same_tensors(qt, ref)
    assert_bits(reload(qt, dtype).dequantize(), qt.dequantize())
    assert sqnr(w.float(), qt.dequantize(torch.float32)) >= sqnr(w.float(), ref.dequantize(torch.float32))


def test_mse_gains_where_the_encoder_searches_less():
    w = weight(seed=5)
    ref = cq.quantize(w, 'asym_w4a8_int8', scale_search=False)
    qt = cq.quantize(w, 'asym_w4a8_int8', rounding='mse', scale_search=False)
    assert sqnr(w, qt.dequantize(torch.float32)) > sqnr(w, ref.dequantize(torch.float32)) + 0.1


@pytest.mark.parametrize('fmt,opts', VARIANTS, ids=IDS)
def test_gptq_files_and_output_gain(fmt, opts):
    w, xc, xe = weight(seed=6), inputs(1024, 512, 7), inputs(512, 512, 8)
    ref = cq.quantize(w, fmt, **opts)
    qt = cq.quantize(w, fmt, rounding='gptq', calibration=xc, **opts)
    same_tensors(qt, ref)
    assert_bits(reload(qt, torch.float32).dequantize(), qt.dequantize())
    y = xe @ w.T
    gain = sqnr(y, xe @ qt.dequantize(torch.float32).T) - sqnr(y, xe @ ref.dequantize(torch.float32).T)
    assert gain > 1.0, gain


def test_asymmetric_variant_is_refused_by_name():
    w, x = weight(), inputs(64, 512, 9)
    for kw in ({'rounding': 'mse'}, {'rounding': 'gptq', 'calibration': x}):
        with pytest.raises(QuantFormatError, match=r"asym_w4a8_int8 has no rounding grid for the options \{'codebook': "
                                                   r"False, 'symmetric': False\}"):
            cq.quantize(w, 'asym_w4a8_int8', symmetric=False, codebook=False, **kw)
    assert FORMATS['asym_w4a8_int8'].grid(w, FORMATS['asym_w4a8_int8'].resolve(None, symmetric=False)) is None
    with pytest.raises(QuantFormatError, match="option 'codebook'"):              # the encoder's option checks
        cq.quantize(w, 'asym_w4a8_int8', codebook=torch.zeros(4, 4), rounding='mse')


def _minilm_layers():
    from cquant.minilm import minilm_path
    if minilm_path() is None: pytest.skip('MiniLM weights not available')
    from cquant.evaluate import EVAL_SENTENCES
    model = cq.minilm_model()
    names = ['encoder.layer.0.intermediate.dense', 'encoder.layer.5.attention.self.query']
    cal = cq.collect_inputs(model, cq.sentence_batches(cq.SENTENCES, 8), names)
    ev = cq.collect_inputs(model, cq.sentence_batches(EVAL_SENTENCES, 8), names)
    return [(n, model.get_submodule(n).weight.detach(), cal[n], ev[n]) for n in names]


@pytest.mark.parametrize('fmt', ('asym_w4a8_int8', 'w6a8_int8'))
def test_gptq_on_minilm_layers(fmt):
    for name, w, xc, xe in _minilm_layers():
        ref = cq.quantize(w, fmt, convrot_groupsize=64)
        qt = cq.quantize(w, fmt, rounding='gptq', calibration=xc, convrot_groupsize=64)
        y = xe @ w.T
        gain = sqnr(y, xe @ qt.dequantize(torch.float32).T) - sqnr(y, xe @ ref.dequantize(torch.float32).T)
        assert gain > 1.5, (name, gain)


@pytest.mark.skipif(ck is None, reason='comfy-kitchen not installed')
@pytest.mark.parametrize('fmt,opts', VARIANTS, ids=IDS)
@pytest.mark.parametrize('dtype', DTYPES)
def test_kitchen_decodes_gptq_tensors_as_cquant(fmt, opts, dtype):
    from comfy_kitchen.tensor import AsymW4A8Int8Layout as KL, QuantizedTensor as KQT
    w = weight(dtype=dtype, seed=10)
    qt = cq.quantize(w, fmt, rounding='gptq', calibration=inputs(256, 512, 11), **opts)
    sd, p = qt.state_dict('m.'), qt.params
    cb = sd.get('m.weight_codebook')
    for odt in DTYPES:
        ref = ck.dequantize_w4a8_int8_weight(sd['m.weight'], sd['m.weight_s_rel'], sd['m.weight_s_channel'], cb, None,
                                             p.group_size, p.convrot_groupsize, odt)
        assert_bits(qt.dequantize(odt), ref, f'{fmt} {opts} {dtype} -> {odt}')
    kt = KQT(qt.qdata, 'AsymW4A8Int8Layout',
             KL.Params(scale=p.s_rel, s_channel=p.s_channel, correction=None, codebook=cb, orig_dtype=dtype,
                       orig_shape=tuple(w.shape), group_size=p.group_size, convrot_groupsize=p.convrot_groupsize))
    x = inputs(5, 512, 12).to(dtype)
    assert_bits(F.linear(x, qt), F.linear(x, kt))


@pytest.mark.parametrize('fmt', ('asym_w4a8_int8', 'w6a8_int8'))
@pytest.mark.parametrize('kind', ('zeros', 'zero rows', 'tiny', 'huge'))
def test_extreme_weights(fmt, kind):
    w = weight(32, 256, seed=13)
    w = {'zeros': torch.zeros_like(w), 'zero rows': torch.cat([torch.zeros(8, 256), w[8:]]),
         'tiny': w * 1e-28, 'huge': w * 1e30}[kind]
    ref = cq.quantize(w, fmt)
    for kw in ({'rounding': 'mse'}, {'rounding': 'gptq', 'calibration': inputs(64, 256, 14)}):
        qt = cq.quantize(w, fmt, **kw)                      # quantize checks the stored values before returning
        d = qt.dequantize(torch.float32)
        assert bool(torch.isfinite(d).all()), kw
        if kind in ('zeros', 'zero rows'): assert not d[:8].any()
        if kind == 'zeros': assert not d.any()
        elif kw['rounding'] == 'mse': assert sqnr(w, d) >= sqnr(w, ref.dequantize(torch.float32))
