"""comfy-kitchen's tensor tests, run against cquant's `QuantizedTensor`.

Re-expressed from comfy-kitchen @ 7d86acf: `tests/test_tensor.py` (every class), `tests/test_int8.py`
(`TestTensorWiseINT8Layout`'s dispatch tests), `tests/test_convrot_w4a4.py` (`test_convrot_w4a4_layout_linear_mm_addmm`)
and `tests/test_integration.py` (`TestQuantizedCompile`). Kitchen's run on CUDA only; here each op runs on kitchen's
own tensor (CPU, eager backend, the installed 0.2.40 wheel) and on cquant's, both quantized from one weight (their
storage is bit-identical), and the results must be the same kind (quantized or plain), shape and values.

Fixed in cquant (issue 39):
- view / reshape / flatten to a shape the storage cannot keep (NVFP4, MXFP8, INT8, any packed layout, a transposed
  tensor): the dequantized values, a plain tensor, as kitchen. Before: a TypeError.
- detach gives new inner tensors (kitchen asserts `detached._qdata is not qt._qdata`).
- `__tensor_flatten__` / `__tensor_unflatten__`: `torch.compile(..., fullgraph=True)` traces a linear in every
  format except asym_w4a8_int8 and w6a8_int8, whose grid lookup reads the codebook as Python numbers (without
  fullgraph they run, with a graph break). Before: no format compiled ("Failed to convert args/kwargs to proxy").

Deliberate differences (each asserted below, so a change is noticed):
- A float activation times a quantized weight (F.linear, mm/addmm with `qt.t()`) runs the format's linear, as SPEC
  §4 says: ComfyUI's layer, which quantizes the activation for FP8 (at `input_scale`, 1.0 without one), NVFP4 and
  MXFP8. Kitchen's tensor dequantizes the weight there and leaves the activation to the layer. For FP8 cquant's
  result is kitchen's linear of the activation quantized at scale 1, bit for bit; INT8 agrees with kitchen as is.
- NVFP4 / MXFP8 with both operands quantized on CPU: kitchen raises 'CPU does not support swizzle'; cquant computes
  (NVFP4 emulates the FP4 GEMM in fp32, nbs/03_nvfp4 §8).
- `transpose(0, 1)` of a 2-D tensor is `t()`: it stays quantized (kitchen has no handler and falls back to a plain
  tensor); the values are equal.
- INT8 `mm(a, qt)` with `qt` stored [K, N] (not a weight in `x @ W.T` orientation): cquant dequantizes it, exactly;
  kitchen quantizes the activation as for a linear (within quantization error of cquant's).
- `plain.copy_(qt)`: cquant copies the values; kitchen's copy_ handler fails (AttributeError on the plain tensor).
- `t().view(-1)`: cquant gives the values (a QuantizedTensor reports contiguous strides); kitchen raises torch's
  "view size is not compatible".
- Names: the repr names the format ('nvfp4'), not the layout class; the transposed flag lives on the tensor
  (`_transposed`), not in the params; kitchen's `storage_shape`, `layout_cls`, `Params.clone/to_device` are cquant's
  `qt.qdata.shape`, `qt.layout`, `params.map_tensors`; copy_ errors are TypeErrors in both, cquant's naming the format
  and shape; FP8 params keep the scale dtype they are given (the file loader casts to float32).
"""
import pytest, torch
import torch.nn.functional as F
import cquant as cq
KT = pytest.importorskip('comfy_kitchen.tensor').QuantizedTensor

FORMAT = {'TensorCoreFP8Layout': 'float8_e4m3fn', 'TensorCoreNVFP4Layout': 'nvfp4',
          'TensorCoreMXFP8Layout': 'mxfp8', 'TensorWiseINT8Layout': 'int8_tensorwise'}
LAYOUTS = list(FORMAT)

def pair(x, layout):
    "(kitchen's tensor, cquant's) of `x`, with the same storage."
    k, c = KT.from_float(x, layout), cq.quantize(x, FORMAT[layout])
    assert torch.equal(k._qdata.view(torch.uint8), c.qdata.view(torch.uint8)), layout
    return k, c

def kind(r):
    "('quantized' | 'plain', shape, values) of an op's result."
    if isinstance(r, (KT, cq.QuantizedTensor)): return 'quantized', tuple(r.shape), r.dequantize()
    return 'plain', tuple(r.shape), r

def assert_same(kr, cr):
    (kk, ks, kv), (ck, cs, cv) = kind(kr), kind(cr)
    assert (kk, ks) == (ck, cs)
    assert kv.dtype == cv.dtype and torch.equal(kv, cv)

def bf16(*shape, seed=0): return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()

SAME = {   # ops whose result is the same kind, shape and values in kitchen and cquant
    'view(16,256)': lambda q: q.view(16, 256), 'view(-1)': lambda q: q.view(-1),
    'reshape(32,128)': lambda q: q.reshape(32, 128), 'reshape(-1,128)': lambda q: q.reshape(-1, 128),
    'flatten': lambda q: q.flatten(), 'unsqueeze': lambda q: q.unsqueeze(0), 't': lambda q: q.t(),
    't.t': lambda q: q.t().t(), 'slice': lambda q: q[:8], 'index': lambda q: q[3], 'cat': lambda q: torch.cat([q, q]),
    '+1': lambda q: q + 1.0, '*2': lambda q: q * 2, 'abs': lambda q: q.abs(), 'sum': lambda q: q.sum(),
    'detach': lambda q: q.detach(), 'clone': lambda q: q.clone(), 'contiguous': lambda q: q.contiguous(),
    'float': lambda q: q.float(), 'half': lambda q: q.half(), 'to(copy)': lambda q: q.to(copy=True),
    'to(cpu,f32)': lambda q: q.to('cpu', dtype=torch.float32), 'to(f32,copy)': lambda q: q.to(torch.float32, copy=True),
    'empty_like.copy_': lambda q: torch.empty_like(q, dtype=torch.float16).copy_(q),
    'float.mm': lambda q: torch.mm(q.float(), torch.eye(64)),
}

@pytest.mark.parametrize('op', list(SAME))
@pytest.mark.parametrize('layout', LAYOUTS)
def test_op_matches_kitchen(layout, op):
    k, c = pair(bf16(64, 64), layout)
    assert_same(SAME[op](k), SAME[op](c))

@pytest.mark.parametrize('layout', LAYOUTS)
def test_shape_ops_quantized_or_plain(layout):
    "Kitchen's FP8 view tests and its NVFP4/MXFP8 'falls back' tests: FP8 keeps quantization, the rest give plain values."
    _, c = pair(bf16(64, 64), layout)
    dq = c.dequantize()
    for got, want in ((c.view(16, 256), dq.view(16, 256)), (c.reshape(32, 128), dq.reshape(32, 128)), (c.view(-1), dq.view(-1))):
        assert isinstance(got, cq.QuantizedTensor) == (layout == 'TensorCoreFP8Layout')
        assert torch.equal(kind(got)[2], want)
    t = c.t()
    assert isinstance(t, cq.QuantizedTensor) and t.shape == (64, 64) and t._transposed and t.qdata.data_ptr() == c.qdata.data_ptr()
    assert torch.equal(t.dequantize(), dq.t()) and not c.t().t()._transposed

def test_fp8_views_share_the_scale():
    "Kitchen's TestFP8ViewOperations: quantized through any view, one scale object, orig_shape updated."
    _, c = pair(bf16(2, 3, 4, 5), 'TensorCoreFP8Layout')
    for shape in ((-1,), (6, 20), (2, 12, 5)):
        v = c.view(*shape)
        assert isinstance(v, cq.QuantizedTensor) and v.params.scale is c.params.scale
        assert torch.equal(v.dequantize(), c.dequantize().view(*shape))
    _, c = pair(bf16(64, 64), 'TensorCoreFP8Layout')
    chain = c.view(16, 256).reshape(32, 128).view(4096)
    assert isinstance(chain, cq.QuantizedTensor) and chain.shape == (4096,) and chain.params.scale is c.params.scale
    assert c.view(16, 256).params.orig_shape == (16, 256) and c.t().params.orig_shape == (64, 64)
    assert c.reshape(8, 8, 64).params.orig_shape == (8, 8, 64)

@pytest.mark.parametrize('layout', LAYOUTS)
def test_tensor_protocol(layout):
    "Kitchen's TestQuantizedTensor: detach, clone, to, empty_like, contiguous, params, fallback."
    k, c = pair(bf16(64, 64), layout)
    d = c.detach(); assert isinstance(d, cq.QuantizedTensor) and d._qdata is not c._qdata
    cl = c.clone(); assert cl._qdata is not c._qdata and torch.equal(cl.qdata, c.qdata)
    f = c.float(); assert f.params.orig_dtype == torch.float32 and f.qdata is not None and torch.equal(f.qdata, c.qdata)
    assert f.dequantize().dtype == torch.float32 and c.half().params.orig_dtype == torch.float16
    cp = c.to(torch.float32, copy=True)
    assert cp.qdata.dtype == c.qdata.dtype and cp.qdata.data_ptr() != c.qdata.data_ptr() and torch.equal(cp.qdata, c.qdata)
    e = torch.empty_like(c, dtype=torch.float32)
    assert isinstance(e, cq.QuantizedTensor) and e.qdata.dtype == c.qdata.dtype and e.params.orig_dtype == torch.float32
    r = torch.empty_like(c, dtype=torch.float16, device='cpu'); r.copy_(c)
    assert r.dequantize().dtype == torch.float16 and torch.equal(r.dequantize(), c.dequantize(torch.float16))
    assert c.contiguous().qdata.is_contiguous() and c.is_contiguous() and c.params is c._params
    assert type(c + 1.0) is torch.Tensor
    assert 'QuantizedTensor' in repr(c) and FORMAT[layout] in repr(c) and '(64, 64)' in repr(c)

def test_copy_errors():
    "Kitchen's TestCopyValidation: TypeErrors for a plain source and for another layout."
    c = cq.quantize(bf16(128, 128), 'float8_e4m3fn')
    with pytest.raises(TypeError, match='needs a QuantizedTensor of the same format and shape, got a Tensor'): c.copy_(bf16(128, 128))
    with pytest.raises(TypeError, match='got format nvfp4'): c.copy_(cq.quantize(bf16(128, 128), 'nvfp4'))
    d = cq.quantize(bf16(128, 128, seed=1), 'float8_e4m3fn'); c.copy_(d)
    assert torch.equal(c.qdata.view(torch.uint8), d.qdata.view(torch.uint8)) and torch.equal(c.params.scale, d.params.scale)

def test_plain_copy_from_quantized():
    "Deliberate: plain.copy_(qt) copies the values (kitchen's copy_ handler fails on the plain destination)."
    k, c = pair(bf16(64, 64), 'TensorCoreFP8Layout')
    with pytest.raises(AttributeError, match='_layout_cls'): torch.zeros(64, 64).copy_(k)
    assert torch.equal(torch.zeros(64, 64).copy_(c), c.dequantize().float())

@pytest.mark.parametrize('layout', LAYOUTS)
def test_transpose_int_stays_quantized(layout):
    "Deliberate: transpose(0, 1) is t() (kitchen: a plain tensor); equal values."
    k, c = pair(bf16(32, 64), layout)
    kr, cr = k.transpose(0, 1), c.transpose(0, 1)
    assert type(kr) is torch.Tensor and isinstance(cr, cq.QuantizedTensor) and torch.equal(kr, cr.dequantize())

@pytest.mark.parametrize('layout', LAYOUTS)
def test_transposed_view_gives_values(layout):
    "Deliberate: t().view(-1) is the values (kitchen raises torch's view error)."
    k, c = pair(bf16(32, 64), layout)
    with pytest.raises(RuntimeError, match='view size is not compatible'): k.t().view(-1)
    assert torch.equal(c.t().view(-1), c.dequantize().t().reshape(-1))

def test_fp8_linear_is_comfyuis_layer():
    "Deliberate: a float activation is quantized at scale 1 (no input_scale), as ComfyUI's layer; kitchen's tensor dequantizes."
    x, w, b = bf16(16, 32, seed=1), bf16(64, 32, seed=2), bf16(64, seed=3)
    k, c = pair(w, 'TensorCoreFP8Layout')
    assert torch.equal(F.linear(x, k), F.linear(x, k.dequantize()))                  # kitchen's fallback
    layer = F.linear(KT.from_float(x, 'TensorCoreFP8Layout', scale=torch.tensor(1.0)), k, b)
    assert torch.equal(F.linear(x, c, b), layer) and torch.equal(torch.addmm(b, x, c.t()), layer)
    assert torch.equal(torch.mm(x, c.t()), F.linear(KT.from_float(x, 'TensorCoreFP8Layout', scale=torch.tensor(1.0)), k))
    assert not torch.equal(F.linear(x, c, b), F.linear(x, k.dequantize(), b))
    xq = KT.from_float(x, 'TensorCoreFP8Layout'); cx = cq.quantize(x, 'float8_e4m3fn')   # both quantized: both scaled
    assert torch.equal(F.linear(cx, c, b), F.linear(xq, k, b))
    assert torch.equal(F.linear(cx, w), F.linear(cx.dequantize(), w))                  # only the activation quantized

@pytest.mark.parametrize('layout', ['TensorCoreNVFP4Layout', 'TensorCoreMXFP8Layout'])
def test_blockscaled_both_quantized(layout):
    "Deliberate: kitchen cannot run these on CPU; cquant's is within kitchen's own tolerance of the dequantized math."
    a, b = pair(bf16(64, 128, seed=1), layout), pair(bf16(96, 128, seed=2), layout)
    with pytest.raises(ValueError, match='CPU does not support swizzle'): F.linear(a[0], b[0])
    ref = F.linear(a[1].dequantize(), b[1].dequantize())
    for got in (F.linear(a[1], b[1]), torch.mm(a[1], b[1].t())):
        assert got.shape == (64, 96) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, ref, rtol=0.15, atol=0.15)
    assert torch.equal(torch.mm(a[1], b[1].dequantize().t().contiguous()), a[1].dequantize() @ b[1].dequantize().t())

@pytest.mark.parametrize('per_row', [False, True])
def test_int8_dispatch_matches_kitchen(per_row):
    "Kitchen's TestTensorWiseINT8Layout dispatch tests: linear, mm, addmm, in the activation's dtype; values equal kitchen's."
    w32, b32 = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)), torch.randn(64)
    k = KT.from_float(w32, 'TensorWiseINT8Layout', per_channel=per_row)
    c = cq.quantize(w32, 'int8_tensorwise', per_row=per_row)
    assert torch.equal(k._qdata, c.qdata)
    x16 = torch.randn(4, 128, generator=torch.Generator().manual_seed(5)).half()
    for op in (lambda q: F.linear(x16, q, b32), lambda q: torch.mm(x16, q.t()), lambda q: torch.addmm(b32.half(), x16, q.t())):
        kr, cr = op(k), op(c)
        assert cr.dtype == torch.float16 and cr.shape == (4, 64)
        torch.testing.assert_close(cr.float(), kr.float(), rtol=1e-2, atol=1e-1)
    kb, cb = pair(torch.randn(128, 64).bfloat16(), 'TensorWiseINT8Layout')      # stored [K, N], as kitchen's mm test
    a16 = torch.randn(8, 128).half()
    got = torch.mm(a16, cb)             # deliberate: not a weight in x @ W.T orientation, so data: dequantized (exact)
    assert got.dtype == torch.float16 and torch.equal(got, torch.mm(a16, cb.dequantize(torch.float16)))
    torch.testing.assert_close(got.float(), torch.mm(a16, kb).float(), rtol=0.05, atol=0.5)   # kitchen quantizes a16

def test_convrot_linear_mm_addmm_agree():
    "Kitchen's test_convrot_w4a4_layout_linear_mm_addmm."
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(5, 256, generator=g), torch.randn(17, 256, generator=g), torch.randn(17, generator=g)
    c = cq.quantize(w, 'convrot_w4a4')
    lin = F.linear(x, c, b)
    assert lin.shape == (5, 17)
    torch.testing.assert_close(lin, torch.mm(x, c.t()) + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin, torch.addmm(b, x, c.t()), rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize('fmt', [f for f in cq.FORMATS if f not in ('asym_w4a8_int8', 'w6a8_int8')])
def test_compile_matches_eager(fmt):
    "Kitchen's TestQuantizedCompile, on CPU through aot_eager: a compiled Linear with a quantized weight equals eager, run after run."
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(256, 128).bfloat16()
    lin.weight = torch.nn.Parameter(cq.quantize(torch.randn(128, 256, generator=g).bfloat16(), fmt), requires_grad=False)
    x = torch.randn(16, 256, generator=g).bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend='aot_eager', fullgraph=True)
    with torch.no_grad():
        ref = lin(x)
        for _ in range(2): assert torch.equal(compiled(x), ref)

def test_compile_graph_breaks_for_w4a8():
    "asym_w4a8_int8 does not trace whole (its grid reads the codebook as numbers): without fullgraph it still runs, equal."
    c = cq.quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(8)), 'asym_w4a8_int8')
    x = torch.randn(4, 256)
    torch._dynamo.reset()
    with pytest.raises(Exception, match='data-dependent'):
        torch.compile(lambda x: F.linear(x, c), backend='aot_eager', fullgraph=True)(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda x: F.linear(x, c), backend='aot_eager')(x), F.linear(x, c))
