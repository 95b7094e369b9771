"""Every notebook in nbs/ is a test module: run each through nbdev's own runner (execnb, in process).

This is what `nbdev-test` does, one pytest test per notebook: cells flagged with a `tst_flags` directive
from pyproject.toml (`#| slow`, `#| gpu`, `#| notest`) are skipped, `#| eval: false` cells never run,
frontmatter `skip_exec: true` skips a notebook, and a `.notest` file skips the notebooks beside it.

    pytest -q tests/test_notebooks.py                  # like `nbdev-test`
    pytest -q tests/test_notebooks.py -k numerics      # one notebook
    NB_FLAGS="slow" pytest -q tests/test_notebooks.py  # also run `#| slow` cells (like `nbdev-test --flags slow`)
"""
import os, tempfile
from pathlib import Path

import pytest
from nbdev.config import get_config
from nbdev.doclinks import nbglob
from nbdev.test import test_nb as run_nb  # alias: pytest would collect a name starting with `test_` and fail

CFG = get_config(Path(__file__).resolve().parent)
NBS = sorted(nbglob(CFG.nbs_path, as_path=True, skip_file_re='^[_.]'), key=lambda p: p.relative_to(CFG.nbs_path).as_posix())
NBS = [p for p in NBS if not (p.parent/'.notest').exists()]
SKIP_FLAGS = CFG.tst_flags.split()
FORCE_FLAGS = os.environ.get('NB_FLAGS', '').split()


def test_there_are_notebooks():
    assert any(p.name == CFG.readme_nb for p in NBS), f'{CFG.readme_nb} missing from {CFG.nbs_path}'


@pytest.fixture(autouse=True)
def registries_restored():
    """A notebook that defines a layout re-registers its format with the notebook's own classes (`__main__`):
    restore the registries after each notebook so the next one sees the package's, as under `nbdev-test`."""
    import inspect, sys
    import cquant.tensor as T
    saved = {name: dict(getattr(T, name)) for name in ('FORMATS', 'LAYOUT_OPS', 'GENERIC_OPS', 'ROUNDINGS')}
    saved['FAST_PATHS'] = {k: list(v) for k, v in T.FAST_PATHS.items()}
    # `@patch` cells re-add methods to the package's classes (e.g. Policy.from_recipe raising the notebook's own
    # RecipeError): put every class of a cquant module back as it was
    classes = {c for n, m in list(sys.modules.items()) if n == 'cquant' or n.startswith('cquant.')
               for _, c in inspect.getmembers(m, inspect.isclass) if c.__module__.startswith('cquant')}
    attrs = {c: dict(vars(c)) for c in classes}
    yield
    for name, value in saved.items():
        reg = getattr(T, name)
        reg.clear(); reg.update(value)
    for c, d in attrs.items():
        for k in set(vars(c)) - set(d):
            try: delattr(c, k)
            except (AttributeError, TypeError): pass
        for k, v in d.items():
            if vars(c).get(k) is not v and k not in ('__dict__', '__weakref__', '__doc__'):
                try: setattr(c, k, v)
                except (AttributeError, TypeError): pass


@pytest.mark.parametrize('nb', NBS, ids=[p.relative_to(CFG.nbs_path).with_suffix('').as_posix() for p in NBS])
def test_notebook(nb, monkeypatch, tmp_path):
    monkeypatch.chdir(nb.parent)
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))   # temp files it leaves are validated (tests/conftest.py)
    ok, secs = run_nb(nb, skip_flags=SKIP_FLAGS, force_flags=FORCE_FLAGS, basepath=CFG.config_path,
                      cell_timeout=int(CFG.get('cell_timeout', 600)))
    print(f'{nb.name}: {secs:.1f}s')
    assert ok, f'{nb.name} failed (the traceback of the failing cell is printed above)'
