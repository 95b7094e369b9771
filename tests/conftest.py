"""Session-wide test setup.

Triton reads TRITON_INTERPRET when kernels are defined, and importing comfy-kitchen (whose triton backend
defines kernels) before it is set leaves cquant's kernels unable to run under the CPU interpreter. So on
machines without CUDA the interpreter is switched on here, before any test module imports anything.
"""
import os
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")


import glob, json, pytest


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
    import pathlib, subprocess, sys, triton
    if not (pathlib.Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'ptxas').exists():
        pytest.skip("triton's bundled ptxas is missing")
    def run(script:str, *argv:str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ('TRITON_INTERPRET', 'CQUANT_TRITON_INTERPRET')}
        env['TRITON_CACHE_DIR'] = str(tmp_path)                    # a fresh cache: really compiled here
        env['PYTHONPATH'] = os.pathsep.join([str(pathlib.Path(__file__).parents[1]), env.get('PYTHONPATH', '')])
        r = subprocess.run([sys.executable, '-c', script, *argv], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout
    return run
