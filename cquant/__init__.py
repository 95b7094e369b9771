"""Understand, make, check and explore Comfy quantized checkpoints"""

# Hand-written (no notebook exports this file; nbdev writes only the docstring above). `import cquant` is cheap (the CLI
# answers --help and argument errors without torch). The API loads (each module's `__all__` below, in this order; every
# format registered, every recipe and rounding there, the Triton kernels registered as fast paths when a CUDA GPU and
# triton are present, CQUANT_KERNELS=0 opts out) on the first public name asked of the package (`cq.quantize`,
# `dir(cq)`, `from cquant import *`), or as soon as an import of a module that needs torch finishes
# (`from cquant.tensor import quantize` finds every format registered, as when `import cquant` loaded everything). Helpers shared between modules
# are exported with `#| exporti` (in their module, not in its `__all__`); the CLI (`cquant.cli`) is not re-exported.
# Importing a layout module registers its formats in `FORMATS`; `cquant.formats` finds and imports every format module
# (by its declaration), so no list of format modules is kept here.
import importlib as _importlib, importlib.machinery, sys as _sys, types as _types
from ._version import __version__

_API = ('plain', 'tensor', 'numerics', 'formats', 'sol_attention', 'int8_attention', 'comfy', 'attention_config', 'gguf', 'checkpoint',
        'attention',
        'quality', 'modules', 'models', 'policy', 'recipe', 'plots', 'jobs', 'lora', 'validate', 'explore', 'explorer', 'attention_explore',
        'evaluate', 'rounding', 'calibrate', 'record', 'minilm', 'compare')
_SOME = {'formats': ('FORMAT_MODULES',), 'int8_attention': ('int8_attention', 'prequantize_int8_attention', 'int8_attention_from_prequantized'),
         'lora': ('merge_loras', 'read_lora'),
         'gguf': (), 'compare': ()}   # modules of which cq shows only these names (formats: its format modules; gguf: read through
                                                  # open_checkpoint; compare: `cquant compare`, cq.compare.compare_weights)
_SHADOWED = frozenset(('calibrate', 'evaluate', 'explore', 'int8_attention', 'sol_attention', 'validate'))  # a function and a module
_shadowed = {}    # their functions: importing the submodule later sets the package's attribute to the module
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
    _shadowed.update({n: api[n] for n in _SHADOWED})
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
        if name not in _SHADOWED: return super().__getattribute__(name)
        _load()
        return _shadowed[name]
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

_LIGHT = frozenset(f'{__name__}.{m}' for m in ('_version', 'plain', 'cli', '_modidx'))   # need no torch
_depth, _loading = 0, False

class _Completing:
    "A submodule's loader that loads the rest of the API once the outermost import of a module needing torch is done."
    def __init__(self, loader): self.loader = loader
    def __getattr__(self, name): return getattr(self.loader, name)       # get_code, get_source, ... as the loader's
    def create_module(self, spec): return self.loader.create_module(spec)
    def exec_module(self, module):
        global _depth, _loading
        _depth += 1
        try: self.loader.exec_module(module)
        finally: _depth -= 1
        if _depth == 0 and not (_loaded or _loading):
            _loading = True
            try: _load()
            finally: _loading = False

class _Finder:
    "Gives every `cquant.<module>` that needs torch a `_Completing` loader."
    @staticmethod
    def find_spec(name, path=None, target=None):
        if not name.startswith(__name__ + '.') or name in _LIGHT or _loaded: return None
        spec = _importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None: spec.loader = _Completing(spec.loader)
        return spec

_sys.meta_path.insert(0, _Finder)
