"""Session-wide test setup.

Triton reads TRITON_INTERPRET when kernels are defined, and importing comfy-kitchen (whose triton backend
defines kernels) before it is set leaves cquant's kernels unable to run under the CPU interpreter. So on
machines without CUDA the interpreter is switched on here, before any test module imports anything.
"""
import os
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")


import glob, json, pathlib, signal, subprocess, sys, pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])     # this checkout first, for subprocesses
CLI_ENV = {**os.environ, 'PYTHONPATH': PYTHONPATH, 'MPLBACKEND': 'Agg'}


# Parallel runs (pytest-xdist, `-n auto` in pyproject.toml): each worker gets its share of the CPUs for torch's
# threads, and there are as many workers as CPUs while each can have the memory a notebook peaks at.
WORKER_GIB = 2.5

def _cpus() -> int: return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1

def _available_gib() -> float:
    try:
        with open('/proc/meminfo') as f: return next(int(l.split()[1]) for l in f if l.startswith('MemAvailable:')) / 2**20
    except (OSError, StopIteration): return WORKER_GIB * _cpus()

def pytest_xdist_auto_num_workers(config):
    return max(1, min(_cpus(), int(_available_gib() // WORKER_GIB)))

if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):       # the processes a test starts inherit the count (OMP_NUM_THREADS)
    os.environ['OMP_NUM_THREADS'] = str(max(1, _cpus() // int(os.environ['PYTEST_XDIST_WORKER_COUNT'])))
    torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """After `-m`/`-k` selected: drop a notebook's quick case where its full case runs too (it runs every cell the
    quick one does), and start the long tests first, so that no worker is left with one at the end."""
    case = lambda i: (i.path, i.originalname, getattr(i, 'callspec', None) and i.callspec.id)   # xdist_group suffixes nodeids
    full = {case(i) for i in items if i.get_closest_marker('long')}
    keep = [i for i in items if not ((c := case(i))[2] or '').endswith(':quick') or (*c[:2], c[2][:-len(':quick')]) not in full]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
    items[:] = sorted(keep, key=lambda i: i.get_closest_marker('long') is None)


def written_checkpoints(folder) -> list:
    "The checkpoints under `folder`: each shard index, and each `*.safetensors` file no index there lists as a shard."
    from cquant.checkpoint import INDEX_SUFFIX
    indexes = sorted(glob.glob(os.path.join(glob.escape(str(folder)), '**', '*' + INDEX_SUFFIX), recursive=True))
    shards = set()
    for ix in indexes:
        try:
            with open(ix) as f: wm = json.load(f).get('weight_map', {})
            shards |= {os.path.join(os.path.dirname(ix), s) for s in wm.values() if isinstance(s, str)}
        except (OSError, ValueError, AttributeError): pass        # a broken index: validate reports it
    files = sorted(glob.glob(os.path.join(glob.escape(str(folder)), '**', '*.safetensors'), recursive=True))
    return indexes + [f for f in files if f not in shards and os.path.isfile(f)]


@pytest.fixture(autouse=True)
def written_files_validate(request):
    """After each test that used `tmp_path`, `cquant.validate` every checkpoint it left there: an error fails the test
    (issue 21: every file the suite writes is validated). Tests that write broken files on purpose are marked
    `@pytest.mark.writes_invalid`."""
    use = 'tmp_path' in request.fixturenames and not request.node.get_closest_marker('writes_invalid')
    folder = request.getfixturevalue('tmp_path') if use else None
    yield
    if not use: return
    from cquant.validate import validate
    bad = [e for f in written_checkpoints(folder) for e in validate(f).errors]
    if bad: pytest.fail('cquant validate: errors in files this test wrote (mark it writes_invalid if on purpose):\n'
                        + '\n'.join(bad[:10]), pytrace=False)


@pytest.fixture
def compile_offline(tmp_path):
    """Run a script that `triton.compile`s kernels for a GPUTarget with triton's own ptxas (no GPU), in a fresh
    process without the interpreter and with a fresh cache; returns its stdout. Skips where ptxas is missing."""
    import triton
    if not (pathlib.Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'ptxas').exists():
        pytest.skip("triton's bundled ptxas is missing")
    def run(script:str, *argv:str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ('TRITON_INTERPRET', 'CQUANT_TRITON_INTERPRET')}
        env['TRITON_CACHE_DIR'] = str(tmp_path)                    # a fresh cache: really compiled here
        env['PYTHONPATH'] = PYTHONPATH
        r = subprocess.run([sys.executable, '-c', script, *argv], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout
    return run


def cquant_cli(*argv, fresh:bool=False, code:str|None=None, timeout:float=300) -> tuple:
    """Run the `cquant` command with arguments `argv`: (exit status, stdout, stderr). By default in this process
    (`cquant.cli.run_captured`: `main`, the function the console script calls); `fresh=True` (or `code`, a `python -c`
    script) starts a new interpreter, for what only a process shows: import time, signals, a closed pipe."""
    argv = [str(a) for a in argv]
    if fresh or code is not None:
        cmd = [sys.executable, '-c', code] if code is not None else [sys.executable, '-m', 'cquant.cli', *argv]
        p = subprocess.run(cmd, capture_output=True, text=True, env=CLI_ENV, timeout=timeout, cwd=ROOT,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal, not an xdist worker
        return p.returncode, p.stdout, p.stderr
    from cquant.cli import run_captured
    return run_captured(argv, ROOT)


def pytest_collection_finish(session):
    """What collection imported (torch, cquant, the test modules and their parameters) lives for the whole run:
    `gc.freeze` takes it out of every later collection's walk (the notebooks' teardowns collect, and so does Python
    itself as objects pile up), which otherwise grows with every module imported."""
    import gc
    gc.collect()
    gc.freeze()
