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
