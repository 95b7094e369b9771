"""Understand, make, check and explore Comfy quantized checkpoints

Modules:

- `cquant.attention`: `ComfyAttention`: the child module that reads `<m>.comfy_attention.config`, picks the method ComfyUI would pick, runs it (cquant's references on any device, comfy-kitchen's kernels where they run) and says which one ran and why.
- `cquant.attention_explore`: What `comfy_kitchen_sol` and `comfy_kitchen_int8` do to attention, and to a model's output: error against exact attention as a function of tau, sequence length, head dim and K outliers; SOL's routed blocks; an interactive explorer; and the end-to-end cost of each preference on the DiT and on MiniLM.
- `cquant.awq`: `awq_w4a16`: asymmetric 4-bit weights with one float scale and zero per group of 64 input features, float activations; a data-free encoder (min/max with a per-group clip search) and AWQ's activation-aware one.
- `cquant.convert`: `quantize_checkpoint`: a float (or fp8) safetensors file in, a Comfy quantized file out, streamed tensor by tensor with memory near the largest tensor, atomically, with a per-layer report of what each layer got, why, and what it cost; the `cquant quantize / plan / report / demo` commands.
- `cquant.fp8`: `float8_e4m3fn` and `float8_e5m2`: one fp32 scale per weight, FP8 elements, byte-compatible with comfy-kitchen, without its NaN and fp16-overflow failures.
- `cquant.int8`: Symmetric absmax INT8 weights with one scale per tensor or per row, optional ConvRot rotation, and the linear layer as comfy-kitchen runs it: per-token INT8 activations and an exact integer GEMM.
- `cquant.int8_attention`: SageAttention-style attention as comfy-kitchen's `int8_attention` computes it: K smoothed, Q and K quantized to int8 per block of tokens, an exact integer $QK^\top$, an fp32 online softmax, unsigned int8 probabilities times per-channel int8 V. A blocked pure-torch reference that runs on any device, and its error against exact attention.
- `cquant.kernels.int8_attention`: A FlashAttention-style Triton forward kernel for `int8_attention`: int8 $QK^\top$, fp32 online softmax, uint8 P times int8 V, over the buffers of `prequantize_int8_attention`; tested against the torch reference.
- `cquant.lora`: `merge_loras`: one checkpoint with its LoRAs merged, each quantized module re-quantized in its own format and options, read from the LoRA files people have (kohya, diffusers/PEFT, ComfyUI's names); the `cquant merge-lora` command.
- `cquant.mxfp8`: The `mxfp8` format: e4m3 elements, one E8M0 exponent per block of 32 along K stored in the swizzled 128x4 layout, padding to 32, byte-compatible with comfy-kitchen, and a linear that runs on CPU.
- `cquant.nvfp4`: The `nvfp4` format: 4-bit E2M1 elements in blocks of 16, an FP8 (E4M3) scale per block and one fp32 scale per tensor, packed two per byte with swizzled block scales; bit-exact with comfy-kitchen.
- `cquant.policy`: Policies as plain data: modes with their shape fallbacks, architecture presets and auto-detection, the nested deterministic INT8 budget of `int4_mixed`, and a measured selection that spends the same budget where the quantization error actually is.
- `cquant.recipe`: YAML (or TOML) recipe files that a user edits: a base policy, ordered glob / regex / substring rules with a format and options, exclude and keep_float lists and a fallback, compiled to the one `Policy`, with errors naming the file, line and key; and the recipe of a plan (every layer's decision, grouped where layers agree).
- `cquant.svdquant`: SVDQuant (Li et al. 2024): a 4-bit residual with per-64 group scales and 4-bit activations, a 16-bit rank-R branch that absorbs the outliers, and a smoothing factor, stored as comfy-kitchen's `TensorCoreSVDQuantW4A4Layout`; the calibrated quantizer kitchen lacks, and kitchen's eager linear on CPU.
- `cquant.validate`: `validate`: would ComfyUI's loader load each module of a checkpoint, and compute what cquant computes? Per-module rows (ok, warning, error) with the reason, at a chosen ComfyUI loader level and on a table of device classes; the `cquant validate` command.
- `cquant.w4a4`: ConvRot W4A4: Hadamard-rotated weights with one symmetric int4 scale per output row, packed two per byte, and the two linears ComfyUI runs on them (int4 or int8 activations).
- `cquant.w4a8`: Grouped 4-bit (Lloyd-Max codebook, uniform or asymmetric) and 6-bit weights on ConvRot-rotated rows, decoded exactly onto the int8 grid the GEMM multiplies, with an encoder that beats kitchen's."""

# Hand-written (no notebook exports this file; nbdev writes only the docstring above). `import cquant` is cheap (the CLI
# answers --help and argument errors without torch); the first public name asked of it (`cq.quantize`, `dir(cq)`,
# `from cquant import *`) imports the API (each module's `__all__` below, in this order) and registers the Triton kernels
# as fast paths when a CUDA GPU and triton are present (CQUANT_KERNELS=0 opts out). Helpers shared between modules
# are exported with `#| exporti` (in their module, not in its `__all__`); the CLI (`cquant.cli`) is not re-exported.
# Importing a layout module registers its formats in `FORMATS`; `cquant.formats` finds and imports every format module
# (by its declaration), so no list of format modules is kept here.
import importlib as _importlib, sys as _sys, types as _types
from ._version import __version__

_API = ('plain', 'tensor', 'numerics', 'formats', 'sol_attention', 'int8_attention', 'comfy', 'checkpoint', 'attention',
        'quality', 'modules', 'models', 'policy', 'recipe', 'convert', 'lora', 'validate', 'explore', 'attention_explore',
        'evaluate', 'rounding', 'calibrate', 'record', 'minilm')
_SOME = {'formats': ('FORMAT_MODULES',), 'int8_attention': ('int8_attention', 'prequantize_int8_attention', 'int8_attention_from_prequantized'),
         'lora': ('merge_loras', 'read_lora')}   # modules of which cq shows only these names (formats: its format modules)
_SHADOWED = frozenset(('calibrate', 'evaluate', 'explore', 'int8_attention', 'sol_attention', 'validate'))  # a function and a module
_loaded = False

def _load():
    "Import the API into the package, once."
    global _loaded
    if _loaded: return
    api = {}
    for name in _API:
        module = _importlib.import_module(f'.{name}', __name__)
        api.update({n: getattr(module, n) for n in _SOME.get(name, module.__all__)})
        if name == 'formats':
            for m in module.FORMAT_MODULES: api.update({n: getattr(m, n) for n in m.__all__})   # every format's API
    globals().update(api)
    _loaded = True
    _enable_kernels()

def _enable_kernels():
    "Register the Triton kernels as fast paths when a CUDA GPU and triton are present (CQUANT_KERNELS=0 opts out)."
    import os, torch
    if os.environ.get('CQUANT_KERNELS', '1') == '0' or not torch.cuda.is_available(): return
    try: from .kernels.dispatch import enable
    except ImportError: return          # triton is not installed: the eager layouts run
    enable()

class _Package(_types.ModuleType):
    "The package, importing its API on first use; a name that is both a submodule and a function is the function, as before."
    def __getattribute__(self, name):
        if name in _SHADOWED and not _loaded: _load()
        return super().__getattribute__(name)
    def __getattr__(self, name):
        if name == '__all__':
            _load()
            return [n for n, v in globals().items() if not n.startswith('_') and not isinstance(v, _types.ModuleType)]
        if name.startswith('__') or _loaded: raise AttributeError(f"module 'cquant' has no attribute {name!r}")
        _load()
        return super().__getattribute__(name)
    def __dir__(self):
        _load()
        return list(globals())

_sys.modules[__name__].__class__ = _Package
