"""cquant: understand, make, check and explore Comfy quantized checkpoints."""
# Hand-written (no notebook exports this file): the version, and the public names gathered from the
# exported modules so that `import cquant as cq` reaches them. Importing a layout module registers its
# formats in `FORMATS`.
__version__ = "0.1.0"

import importlib as _importlib

from .tensor import *

for _mod in ("numerics", "fp8", "nvfp4", "mxfp8", "int8"):
    try: _m = _importlib.import_module(f".{_mod}", __name__)
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_mod}": raise
        continue
    globals().update({_k: getattr(_m, _k) for _k in getattr(_m, "__all__", [])})
del _importlib, _mod
