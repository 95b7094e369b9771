"""One-way layers in `cquant.kernels`: no private name crosses a module boundary, and the kernel format modules
import only `base` (and `dispatch`) of their own package, never each other."""
import ast, pathlib
import pytest

KERNELS = pathlib.Path(__file__).parents[1] / 'cquant' / 'kernels'
SHARED = {'base', 'dispatch'}


def _imports(path):
    "(line, absolute module, imported names) of every `from ... import ...` in the file at `path`."
    pkg = ['cquant', 'kernels']
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = '.'.join(base + ([node.module] if node.module else []))
            yield node.lineno, mod, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names: yield node.lineno, a.name, []


def violations(path) -> list:
    "The rule breaks of one kernel module: private cquant names imported, or an import of another format module."
    out, me = [], path.stem
    for line, mod, names in _imports(path):
        if not mod.startswith('cquant'): continue
        priv = [n for n in names if n.startswith('_') and n != '__future__']
        if priv: out.append(f'{path.name}:{line}: private names from {mod}: {priv}')
        parts = mod.split('.')
        targets = [parts[2]] if len(parts) > 2 and parts[1] == 'kernels' else (names if mod == 'cquant.kernels' else [])
        for t in targets:
            if t not in SHARED and t != me and me not in SHARED | {'__init__'}:
                out.append(f'{path.name}:{line}: kernel module {me!r} imports kernel module {t!r} (only base/dispatch)')
        if me == 'base' and targets:
            out.append(f'{path.name}:{line}: base imports a kernel module ({mod})')
    return out


def test_kernel_modules_found():
    names = {p.stem for p in KERNELS.glob('*.py')}
    assert {'base', 'dispatch', 'int8', 'fp8', 'blockscaled', 'convrot', 'w4a8', 'lowbit'} <= names


@pytest.mark.parametrize('path', sorted(KERNELS.glob('*.py')), ids=lambda p: p.name)
def test_no_private_or_sideways_imports(path):
    assert violations(path) == []


def test_checker_catches_both_rules(tmp_path):
    "The checker itself: a private import of a cquant module and a sideways kernel import are both reported."
    bad = tmp_path / 'fp8.py'
    bad.write_text('from .base import jit\nfrom .int8 import quantize_rows_int8\nfrom ..nvfp4 import _check\n'
                   'from cquant.kernels.convrot import w4a4_mm\nfrom torch import _C\n')
    got = violations(bad)
    assert len(got) == 3, got
    assert "imports kernel module 'int8'" in got[0] and 'private names from cquant.nvfp4' in got[1]
    assert "imports kernel module 'convrot'" in got[2]
    base = tmp_path / 'base.py'
    base.write_text('from .int8 import int8_mm\nfrom ..numerics import hadamard\n')
    assert violations(base) == ["base.py:1: base imports a kernel module (cquant.kernels.int8)"]
