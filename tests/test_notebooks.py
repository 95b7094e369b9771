"""Every notebook in nbs/ is a test module: run each through nbdev's own runner (execnb, in process).

This is what `nbdev-test` does, one pytest test per notebook: cells flagged with a `tst_flags` directive
from pyproject.toml (`#| slow`, `#| gpu`, `#| notest`) are skipped, `#| eval: false` cells never run,
frontmatter `skip_exec: true` skips a notebook, and a `.notest` file skips the notebooks beside it.

Cells flagged `#| long` (the studies that take tens of seconds) run in the full run and are left out of the quick
tier: a notebook with such cells is two tests, `[nb]` (every cell, marked `long`) and `[nb:quick]` (its other cells),
and where both are selected only the first runs (tests/conftest.py).

    pytest -q tests/test_notebooks.py                  # every notebook, every cell nbdev-test runs and the long ones
    pytest -q -m "not long" tests/test_notebooks.py    # the quick tier: the long cells left out
    pytest -q tests/test_notebooks.py -k numerics      # one notebook
    NB_FLAGS="slow" pytest -q tests/test_notebooks.py  # also run `#| slow` cells (like `nbdev-test --flags slow`)
"""
import os, tempfile
from pathlib import Path

import pytest
from nbdev.config import get_config
from fastcore.nbio import read_nb
from nbdev.doclinks import nbglob
from nbdev.test import test_nb as run_nb  # alias: pytest would collect a name starting with `test_` and fail

CFG = get_config(Path(__file__).resolve().parent)
NBS = sorted(nbglob(CFG.nbs_path, as_path=True, skip_file_re='^[_.]'), key=lambda p: p.relative_to(CFG.nbs_path).as_posix())
NBS = [p for p in NBS if not (p.parent/'.notest').exists()]
SKIP_FLAGS = CFG.tst_flags.split()
FORCE_FLAGS = os.environ.get('NB_FLAGS', '').split()
LONG = 'long'     # the cell flag of the full run (a tst_flag, so `nbdev-test` leaves these cells out too)
# Full runs that peak at 1.6-2.5 GB (VmHWM per test, session 22): one xdist worker runs them one after another, so
# two never add up (the test run's peak stays under 4 GB with two workers)
HEAVY = ('07a_awq', '07b_svdquant', '13_models', '15a_record', '23_rounding')


def _has_long_cells(nb:Path) -> bool:
    return any(c.cell_type == 'code' and c.directive(LONG) is not None for c in read_nb(nb).cells)


def _cases() -> list:
    "One case per notebook; a notebook with long cells also has its quick case."
    cases = []
    for nb in NBS:
        name = nb.relative_to(CFG.nbs_path).with_suffix('').as_posix()
        if not _has_long_cells(nb): cases.append(pytest.param(nb, False, id=name))
        else:
            marks = [pytest.mark.long] + [pytest.mark.xdist_group('heavy')] * (name in HEAVY)
            cases += [pytest.param(nb, True, id=name, marks=marks), pytest.param(nb, False, id=name + ':quick')]
    return cases

CASES = _cases()


def test_there_are_notebooks():
    assert any(p.name == CFG.readme_nb for p in NBS), f'{CFG.readme_nb} missing from {CFG.nbs_path}'


def test_long_notebooks_have_a_quick_case():
    "A notebook with `#| long` cells is a full case marked `long` and a quick case; the others are one unmarked case."
    cases = {c.id: c for c in CASES}
    long_nbs = [nb for nb in NBS if _has_long_cells(nb)]
    assert any(nb.stem == '23_rounding' for nb in long_nbs) and set(HEAVY) <= {nb.stem for nb in long_nbs}
    for nb in NBS:
        name = nb.relative_to(CFG.nbs_path).with_suffix('').as_posix()
        assert [m.name for m in cases[name].marks] == (['long'] if nb in long_nbs else []) + ['xdist_group'] * (name in HEAVY)
        assert (name + ':quick' in cases) == (nb in long_nbs) and cases[name].values[1] == (nb in long_nbs)


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


@pytest.fixture
def shells_freed(monkeypatch):
    """Free each notebook's namespace when it ends: IPython keeps every shell it made reachable (its magics, display
    hooks and `__main__` hold it), so without this the run's memory grows by what every notebook left (2 GB for one)."""
    import gc, nbdev.test
    made = []
    class Shell(nbdev.test.CaptureShell):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(nbdev.test, 'CaptureShell', Shell)
    yield
    for shell in made:
        # reset's display-hook flush runs a full collection while the namespace still holds everything (0.2-0.5 s
        # a notebook, a heap walk that frees little): skipped, the one collection below frees it all
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gc, 'collect', lambda *args: 0)
            shell.reset(new_session=False)
        shell.user_ns.clear()
    made.clear()
    gc.collect()
    from cquant.runtime import trim_heap
    trim_heap()


@pytest.fixture
def figures_drawn(monkeypatch) -> list:
    """Draw each figure a cell shows, once, at its own dpi, and encode no image: nbdev's shell would render a retina PNG
    (twice the dpi, drawn twice for the tight bounding box) that a test run throws away, a tenth of some notebooks'
    time. The errors of drawing are collected: IPython's formatter prints them and the cell goes on, so a figure
    that could not be drawn passed before."""
    from IPython.core import pylabtools
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    failed = []
    def draw(fig, *args, **kwargs):             # returns no data: the formatter shows nothing
        try: FigureCanvasAgg(fig).draw()
        except Exception as e: failed.append(f'{type(e).__name__}: {e}')
    for name in ('print_figure', 'retina_figure'): monkeypatch.setattr(pylabtools, name, draw)
    return failed


@pytest.mark.parametrize('nb, long', CASES)
@pytest.mark.usefixtures('shells_freed')
def test_notebook(nb, long, monkeypatch, tmp_path, figures_drawn):
    import nbdev
    # a notebook's last cell exports the package: not in a test run, where other workers import those files meanwhile
    monkeypatch.setattr(nbdev, 'nbdev_export', lambda *args, **kwargs: None)
    monkeypatch.chdir(nb.parent)
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))   # temp files it leaves are validated (tests/conftest.py)
    ok, secs = run_nb(nb, skip_flags=SKIP_FLAGS, force_flags=FORCE_FLAGS + [LONG] * long, basepath=CFG.config_path,
                      cell_timeout=int(CFG.get('cell_timeout', 600)))
    print(f'{nb.name}: {secs:.1f}s')
    assert ok, f'{nb.name} failed (the traceback of the failing cell is printed above)'
    assert not figures_drawn, f'{nb.name}: figures that could not be drawn: {figures_drawn}'


def test_a_figure_that_cannot_be_drawn_fails(tmp_path, figures_drawn):
    "The notebook runs on (IPython prints the drawing error), and `figures_drawn` holds the error the test fails on."
    import nbformat
    cell = ("import matplotlib.pyplot as plt\nfrom matplotlib.artist import Artist\n"
            "class Broken(Artist):\n    def draw(self, renderer): raise ValueError('no ink')\n"
            "fig, ax = plt.subplots(); ax.add_artist(Broken()); plt.show()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell), nbformat.v4.new_code_cell("plt.close('all')")])
    nbformat.write(nb, tmp_path/'broken.ipynb')
    ok, _ = run_nb(tmp_path/'broken.ipynb')
    assert ok and figures_drawn == ['ValueError: no ink'], figures_drawn


def test_a_full_case_drops_its_quick_case_also_in_an_xdist_group():
    "xdist_group appends '@heavy' to a nodeid: the quick case of a heavy notebook is still left out where its full case runs."
    from types import SimpleNamespace as NS
    from conftest import pytest_collection_modifyitems
    def item(case, long, group=''):
        return NS(nodeid=f'tests/test_notebooks.py::test_notebook[{case}]{group}', path='tests/test_notebooks.py',
                  originalname='test_notebook', callspec=NS(id=case), get_closest_marker=lambda m: long if m == 'long' else None)
    items = [item('a', True, '@heavy'), item('a:quick', False), item('b', True), item('b:quick', False), item('c:quick', False)]
    gone = []
    pytest_collection_modifyitems(NS(hook=NS(pytest_deselected=lambda items: gone.extend(items))), items)
    assert [i.callspec.id for i in items] == ['a', 'b', 'c:quick'] and [i.callspec.id for i in gone] == ['a:quick', 'b:quick']
