"Tensor behaviours comfy-kitchen's tensor tests and ComfyUI's loader expect: writes, copies, views, dtypes, stray scales."
import pytest, torch, torch.nn as nn, torch.nn.functional as F
import cquant as cq
from cquant.tensor import QuantizedTensor, QuantFormatError
from cquant.tensor import test_bits as assert_bits

def test_fp8_copy_from_nvfp4_refused():
    w = torch.randn(32, 64)
    dst, src = cq.quantize(w, 'float8_e4m3fn'), cq.quantize(w * 2, 'nvfp4')
    before = dst.qdata.clone()
    with pytest.raises(TypeError, match="copy_.default into a float8_e4m3fn QuantizedTensor .* got format nvfp4"): dst.copy_(src)
    assert_bits(dst.qdata, before)

def test_empty_like_copy_is_a_copy():
    qt = cq.quantize(torch.randn(32, 64), 'int8_tensorwise', per_row=True)
    e = torch.empty_like(qt).copy_(qt)
    assert isinstance(e, QuantizedTensor) and e.qdata.data_ptr() != qt.qdata.data_ptr()
    assert_bits(e.dequantize(), qt.dequantize())

def test_int8_addmm_alpha_fp16_against_fp32_weight():
    qt = cq.quantize(torch.randn(16, 32), 'int8_tensorwise'); x = torch.randn(4, 32).half(); b = torch.randn(16)
    got = torch.addmm(b, x, qt.t(), alpha=2)
    assert_bits(got, torch.addmm(b.half(), x, qt.dequantize(torch.float16).t(), alpha=2))

def test_stray_scale_one_rule():
    q = cq.quantize(torch.randn(8, 16), 'float8_e4m3fn')
    sd = {'0.weight': q.qdata, '0.weight_scale': q.params.scale}
    with pytest.raises(QuantFormatError, match=r"convert_legacy\(state dict\): '0.weight_scale'"): cq.convert_legacy(sd)
