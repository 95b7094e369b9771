"""ComfyUI's unit tests of attention preferences, run against cquant's loader.

Re-expressed from Comfy-Org/ComfyUI `tests-unit/comfy_test/attention_metadata_test.py` @ b806797 (the issue names it
`tests-unit/comfy_quant/test_attention_metadata.py`). ComfyUI's model of two MiniMax attention blocks is cquant's DiT
(its `blocks.N.attn` modules carry a `ComfyAttention` child); ComfyUI's `load_model_weights` is
`cq.load_quantized_model`; its mocked "kitchen INT8 attention is available" is cquant's CPU reference of that method.

Deliberate differences (nbs/12a_attention states them):
- An entry whose method *name* cquant does not run ('', 'unknown_attention', 'pytorch', 'optimized', a name another
  program registered) gets ComfyUI's warning, word for word, then "(not a method cquant runs; kept in the file)": it is
  kept in `config` and saved back, so a file passes through cquant unchanged. ComfyUI drops it. Malformed *values*
  (None, [], {}) are dropped and not saved back, as ComfyUI does (its message, then what is wrong).
- The method is chosen at each call, on the device of Q (ComfyUI probes the device once, at load): cquant's test is
  that the choice follows the device and the `available` set it is given.
- A preference on a module the model lacks or on a layer is an unexpected key, as in ComfyUI; cquant's loader is strict
  by default, so it raises `LoadKeysError` naming the key (`strict=False`: a `LoadKeysWarning`, as ComfyUI's log line).
- Not applicable: ModelPatcher key patches (cquant has no patcher), AttentionTensorContainer, the prequantized kernel
  path and the qwen_image21 helpers (ComfyUI internals with no cquant counterpart).
"""
import json, warnings
from unittest.mock import Mock
import pytest, torch
import cquant as cq
from cquant.attention import ComfyAttention, exact_attention

INT8 = {'attention': 'comfy_kitchen_int8'}
KEY = 'blocks.0.attn.comfy_attention.config'

def make_model(): return cq.dit_model(heads=2, depth=2, dtype=torch.bfloat16)

def model_weights(model): return {k: v for k, v in model.state_dict().items() if not k.endswith('comfy_attention.config')}

def warned(fn):
    "(result, [CheckpointWarning messages]) of fn()."
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        out = fn()
    return out, [str(m.message) for m in w if issubclass(m.category, cq.CheckpointWarning)]

def run_block(model, i):
    "Run block i's attention on bf16 activations (head dim 128 there); what ran."
    a = model.blocks[i].attn
    a(torch.randn(1, 16, a.qkv.in_features, dtype=torch.bfloat16))
    return a.comfy_attention.last.method

def test_metadata_checkpoint_round_trip(tmp_path):
    model = make_model()
    weights = {**model_weights(model), KEY: cq.encode_json(INT8)}
    cq.load_quantized_model(model, weights)
    assert model.blocks[0].attn.comfy_attention.config == INT8
    assert model.blocks[0].attn.comfy_attention.chosen('cpu').method == 'comfy_kitchen_int8'
    assert model.blocks[1].attn.comfy_attention.config is None
    path = tmp_path / 'model.safetensors'
    cq.save_file(model.state_dict(), path)
    loaded = cq.load_file(path)
    assert json.loads(bytes(loaded[KEY].tolist())) == INT8
    assert all(m['format'] is None for m in cq.inspect_checkpoint(path)['modules'])   # not a quantized checkpoint
    restored = cq.load_quantized_model(make_model(), loaded)
    assert restored.blocks[0].attn.comfy_attention.config == INT8 and restored.blocks[1].attn.comfy_attention.config is None

@pytest.mark.parametrize('assign', [False, True])
def test_child_module_loads_and_saves_without_base_model(assign):
    parent = torch.nn.Module()
    parent.comfy_attention = ComfyAttention()
    assert not parent.state_dict()
    parent.load_state_dict({'comfy_attention.config': cq.encode_json(INT8)}, assign=assign)
    parent.to(device='meta', dtype=torch.bfloat16)
    saved = parent.state_dict()
    assert saved['comfy_attention.config'].device == torch.device('cpu') and saved['comfy_attention.config'].dtype == torch.uint8
    restored = torch.nn.Module()
    restored.comfy_attention = ComfyAttention()
    restored.load_state_dict(saved, assign=assign)
    assert restored.comfy_attention.config == INT8 and restored.comfy_attention.chosen('cpu').method == 'comfy_kitchen_int8'
    restored.load_state_dict({})
    assert restored.comfy_attention.chosen('cpu') is None and not restored.state_dict()

def test_metadata_only_changes_target_module():
    model = make_model()
    cq.load_quantized_model(model, {**model_weights(model), KEY: cq.encode_json(INT8)})
    assert [run_block(model, 0), run_block(model, 1)] == ['comfy_kitchen_int8', 'exact']
    model.load_state_dict(model_weights(model))
    assert model.blocks[0].attn.comfy_attention.config is None and run_block(model, 0) == 'exact'

def test_attention_metadata_does_not_enable_weight_quantization(tmp_path):
    model = make_model()
    weights = {**model_weights(model), KEY: cq.encode_json(INT8)}
    cq.save_file(weights, tmp_path / 'a.safetensors')
    assert {m['format'] for m in cq.inspect_checkpoint(tmp_path / 'a.safetensors')['modules']} == {None}
    weights.update(cq.quantize(weights['blocks.0.attn.qkv.weight'], 'float8_e4m3fn').state_dict('blocks.0.attn.qkv.'))
    weights['blocks.0.attn.qkv.comfy_quant'] = cq.encode_json({'format': 'float8_e4m3fn'})
    cq.save_file(weights, tmp_path / 'b.safetensors')
    got = {m['module']: m['format'] for m in cq.inspect_checkpoint(tmp_path / 'b.safetensors')['modules'] if m['format']}
    assert got == {'blocks.0.attn.qkv': 'float8_e4m3fn'}

COMFYUI_TEXT = "Ignoring unsupported attention method {!r} for blocks.0.attn.comfy_attention"

def load_with_method(method):
    "ComfyUI's setup: block 0 prefers `method`, block 1 INT8. (model, weights, warnings)."
    model = make_model()
    weights = {**model_weights(model), KEY: cq.encode_json({'attention': method}),
               'blocks.1.attn.comfy_attention.config': cq.encode_json(INT8)}
    _, msgs = warned(lambda: cq.load_quantized_model(model, weights))
    return model, weights, msgs

@pytest.mark.parametrize('method', [None, [], {}])
def test_malformed_attention_method_is_ignored(method):
    "As ComfyUI: dropped with its warning, the other block unaffected, and not saved back."
    model, _, msgs = load_with_method(method)
    assert len(msgs) == 1 and msgs[0].startswith(COMFYUI_TEXT.format(method) + ': ')
    assert model.blocks[0].attn.comfy_attention.config is None and KEY not in model.state_dict()
    assert [run_block(model, 0), run_block(model, 1)] == ['exact', 'comfy_kitchen_int8']

@pytest.mark.parametrize('method', ['', 'unknown_attention', 'pytorch', 'optimized', 'registered_attention'])
def test_unsupported_attention_name_is_ignored_and_kept(method):
    "ComfyUI's warning and normal attention; deliberately kept in the file for the round trip."
    model, weights, msgs = load_with_method(method)
    assert msgs == [COMFYUI_TEXT.format(method) + ' (not a method cquant runs; kept in the file)']
    assert [run_block(model, 0), run_block(model, 1)] == ['exact', 'comfy_kitchen_int8']
    assert torch.equal(model.state_dict()[KEY], weights[KEY])

@pytest.mark.parametrize('module_name', ['blocks.0.attn.qkv', 'blocks.2'])
def test_invalid_metadata_target_is_ignored_without_decoding(module_name, monkeypatch):
    model = make_model()
    key = f'{module_name}.comfy_attention.config'
    weights = {**model_weights(model), key: cq.encode_json(INT8)}
    decode = Mock(side_effect=AssertionError('a preference on a non-attention module must not be decoded'))
    monkeypatch.setattr(json, 'loads', decode)
    with pytest.raises(cq.LoadKeysError, match=f'{module_name}.comfy_attention: config'):
        cq.load_quantized_model(make_model(), weights)
    with pytest.warns(cq.LoadKeysWarning, match=f'{module_name}.comfy_attention: config'):
        cq.load_quantized_model(model, weights, strict=False)
    decode.assert_not_called()
    assert key in model.load_result.unexpected_keys
    assert all(b.attn.comfy_attention.config is None for b in model.blocks)
    assert torch.equal(model.blocks[0].attn.qkv.weight, weights['blocks.0.attn.qkv.weight'])

def test_missing_backend_preserves_original_attention():
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    a, msgs = warned(lambda: ComfyAttention({'attention': 'unavailable_method'}, 'blocks.0.attn'))
    assert torch.equal(a(q, k, v), exact_attention(q, k, v)) and a.last.method == 'exact'
    assert msgs == [COMFYUI_TEXT.format('unavailable_method') + ' (not a method cquant runs; kept in the file)']

def test_user_override_takes_precedence():
    q, k, v = (torch.randn(1, 2, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    a = ComfyAttention(INT8, 'blocks.0.attn')
    a(q, k, v); assert a.last.method == 'comfy_kitchen_int8'
    assert torch.equal(a(q, k, v, override='exact'), exact_attention(q, k, v)) and a.last.reason == 'override'

def test_unavailable_kitchen_keeps_metadata_and_normal_attention():
    q, k, v = (torch.randn(1, 2, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    a, msgs = warned(lambda: ComfyAttention(INT8, 'blocks.0.attn', available=()))
    assert a.chosen('cpu') is None and torch.equal(a(q, k, v), exact_attention(q, k, v))
    assert a.last.reason == 'no usable preference' and not msgs
    assert json.loads(bytes(a.state_dict()['config'].tolist())) == INT8

def test_kitchen_preserves_full_precision_with_mask_and_gqa():
    "A masked call (here with GQA: K/V with fewer heads) is exact attention, whatever the preference."
    q = torch.randn(1, 4, 3, 8)
    k, v = (torch.randn(1, 2, 5, 8) for _ in range(2))
    mask = torch.zeros(3, 5)
    a = ComfyAttention(INT8, 'blocks.0.attn')
    assert torch.equal(a(q, k, v, mask=mask), exact_attention(q, k, v, mask))
    assert (a.last.method, a.last.reason) == ('exact', 'masked call')

def test_supported_device_uses_the_method():
    q, k, v = (torch.randn(1, 2, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    a = ComfyAttention(INT8, 'blocks.0.attn')
    out = a(q, k, v)
    assert a.last.method == 'comfy_kitchen_int8' and out.shape == q.shape
    torch.testing.assert_close(out, exact_attention(q, k, v), rtol=0.1, atol=0.1)   # INT8 Q/K: near exact
