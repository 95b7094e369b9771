"""Sharded safetensors folders (HF / diffusers `*.safetensors.index.json`) as sources of every API and command,
sharded output (`shard_size`, `--shard-size`), batch conversion, and the index errors."""
import json, os, subprocess, sys, warnings
from pathlib import Path

import pytest
import torch

import cquant as cq
from cquant.checkpoint import CheckpointError, ShardedWriter, open_checkpoint, read_header
from cquant.jobs import quantize_checkpoint, report_error
from cquant.models import dit_state_dict
from cquant.policy import Policy, PolicyWarning

from conftest import cquant_cli as cquant

POL = Policy('int4_mixed', preset='none', keep_float=('embed', 'adaLN', 'final_layer'))


def write_shards(folder:Path, sd:dict, n:int, name='diffusion_pytorch_model') -> Path:
    "Split `sd` into `n` shards (keys round-robin by module) with an HF index; the index path."
    folder.mkdir(parents=True, exist_ok=True)
    mods = sorted({k.rpartition('.')[0] for k in sd})
    part = {m: i % n for i, m in enumerate(mods)}
    files = [f'{name}-{i + 1:05d}-of-{n:05d}.safetensors' for i in range(n)]
    wm = {k: files[part[k.rpartition('.')[0]]] for k in sd}
    for i, f in enumerate(files):
        cq.save_file({k: v for k, v in sd.items() if wm[k] == f}, folder / f, {'format': 'pt'})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (folder / f'{name}.safetensors.index.json').write_text(json.dumps({'metadata': {'total_size': total}, 'weight_map': wm}))
    return folder / f'{name}.safetensors.index.json'


@pytest.fixture(scope='module')
def sd():
    return dit_state_dict(0, torch.bfloat16, depth=1)


@pytest.fixture(scope='module')
def sharded(sd, tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp('src') / 'dit', sd, 3)


def quiet_quantize(*a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        return quantize_checkpoint(*a, progress=False, **k)


def test_open_and_load_folder_or_index(sd, sharded):
    for p in (sharded.parent, sharded):
        with open_checkpoint(p) as ck:
            assert sorted(ck) == sorted(sd) and len(ck.files) == 3
            k = next(iter(sd))
            assert torch.equal(ck[k], sd[k]) and ck.info(k).shape == tuple(sd[k].shape)
        loaded = cq.load_file(p)
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_quantize_from_shards_matches_single_file(sd, sharded, tmp_path):
    one = tmp_path / 'one.safetensors'; cq.save_file(sd, one)
    a = quiet_quantize(one, tmp_path / 'a.safetensors', POL, measure=False)
    b = quiet_quantize(sharded.parent, tmp_path / 'b.safetensors', POL, measure=False)
    assert [r['format'] for r in a.layers] == [r['format'] for r in b.layers] and len(a.quantized()) > 0
    la, lb = cq.load_file(tmp_path / 'a.safetensors'), cq.load_file(tmp_path / 'b.safetensors')
    assert sorted(la) == sorted(lb) and all(torch.equal(la[k].view(torch.uint8), lb[k].view(torch.uint8)) for k in la)
    rep = report_error(sharded, tmp_path / 'b.safetensors')
    assert len(rep.layers) == len(b.layers) and rep.totals['missing'] == []


def test_sharded_output(sd, sharded, tmp_path):
    out = tmp_path / 'out'
    rep = quiet_quantize(sharded, out, POL, measure=False, shard_size='1MB')
    names = sorted(os.listdir(out))
    index = out / 'model.safetensors.index.json'
    assert names[-1] == index.name and len(names) >= 3
    n = len(names) - 1
    assert names[:-1] == [f'model-{i:05d}-of-{n:05d}.safetensors' for i in range(1, n + 1)]
    doc = json.loads(index.read_text())
    whole = cq.load_file(out)
    seen = {}
    for f in names[:-1]:
        part = cq.load_file(out / f)                       # each shard loads (and validates) on its own
        for k in part: seen[k] = f
        mods = {k.rpartition('.')[0] for k in part}
        assert all(k in part for k in whole if k.rpartition('.')[0] in mods)   # a module never splits
        assert read_header(out / f)[1]['cquant_policy'] == POL.to_json()
    assert doc['weight_map'] == {k: seen[k] for k in sorted(seen)}
    assert doc['metadata']['total_size'] == sum(read_header(out / f)[0][k].nbytes for f in names[:-1]
                                                for k in read_header(out / f)[0])
    assert sorted(whole) == sorted(seen)
    assert rep.totals['bytes_after'] == doc['metadata']['total_size']
    big = max(sum(v.numel() * v.element_size() for k, v in whole.items() if k.rpartition('.')[0] == m)
              for m in {k.rpartition('.')[0] for k in whole})
    assert all(os.path.getsize(out / f) <= 10**6 + big + (1 << 17) for f in names[:-1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')]     # no temporary folder left


def test_sharded_output_refuses_full_folder_and_leaves_nothing(sharded, tmp_path):
    full = tmp_path / 'full'; full.mkdir(); (full / 'x').write_text('x')
    with pytest.raises(CheckpointError, match='expected a new or empty folder'):
        quiet_quantize(sharded, full, POL, shard_size='1MB')
    with pytest.raises(ValueError, match='shard_size'):
        quiet_quantize(sharded, tmp_path / 'o', POL, shard_size='lots')
    w = ShardedWriter(tmp_path / 'o', 100)
    w.add('a.weight', torch.ones(64, 64)); w.add('b.weight', torch.ones(64, 64))
    assert len(w.shards) == 2
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['full']


@pytest.mark.writes_invalid
def test_index_errors(sd, tmp_path):
    idx = write_shards(tmp_path / 'm', sd, 2)
    wm = json.loads(idx.read_text())['weight_map']
    one, two = sorted(set(wm.values()))
    k1 = next(k for k, v in wm.items() if v == one)
    k2 = next(k for k, v in wm.items() if v == two)
    bad = lambda doc: idx.write_text(json.dumps(doc))
    bad({'weight_map': {**wm, 'x.weight': 'missing.safetensors'}})
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map\['x\.weight'\]: expected shard 'missing\.safetensors'"):
        open_checkpoint(idx)
    bad({'weight_map': {k: v for k, v in wm.items() if k != k1}})
    with pytest.raises(CheckpointError, match=f"{one}: '{k1}': expected only tensors the index .* does not map"):
        open_checkpoint(idx.parent)
    keep = cq.load_file(idx.parent / two)
    cq.save_file({**keep, k1: sd[k1]}, idx.parent / two)
    bad({'weight_map': wm})
    with pytest.raises(CheckpointError, match=f"{two}: '{k1}': expected each tensor in one shard, found it in {one}"):
        open_checkpoint(idx)
    cq.save_file(keep, idx.parent / two)
    bad({'weight_map': wm, 'extra': 1})
    (idx.parent / 'other.safetensors.index.json').write_text('{}')
    with pytest.raises(CheckpointError, match=r"expected a sharded checkpoint folder with one .*found 2"):
        open_checkpoint(idx.parent)
    (idx.parent / 'other.safetensors.index.json').write_text('[1]')
    with pytest.raises(CheckpointError, match='other.safetensors.index.json: expected an object with a "weight_map"'):
        open_checkpoint(idx.parent / 'other.safetensors.index.json')
    assert k2 in cq.load_file(idx)   # an index with extra keys is still read


@pytest.mark.long
def test_cli_over_shards(sharded, tmp_path):
    rc, out, err = cquant('inspect', sharded.parent)
    assert rc == 0, err
    assert 'diffusion_pytorch_model.safetensors.index.json' in out.splitlines()[0]
    rc, out, err = cquant('plan', sharded, '--preset', 'none', '--json')
    assert rc == 0, err
    assert len(json.loads(out)['layers']) > 0
    rc, out, err = cquant('quantize', sharded.parent, tmp_path / 'q', '--preset', 'none', '--shard-size', '1MB',
                          '--no-sqnr', '--quiet', '--hash-output')
    assert rc == 0, err
    assert (tmp_path / 'q' / 'model.safetensors.index.json').exists() and (tmp_path / 'q.sha256').exists()
    rc, out, err = cquant('report', sharded.parent, tmp_path / 'q', '--json')
    assert rc == 0, err
    assert json.loads(out)['totals']['missing'] == []
    rc, out, err = cquant('inspect', tmp_path / 'q', '--json')
    assert rc == 0, err
    assert json.loads(out)['provenance']['cquant_sources'][0]['name'] == sharded.name


@pytest.mark.long
def test_batch_conversion(sd, sharded, tmp_path):
    srcs = tmp_path / 'srcs'; srcs.mkdir()
    cq.save_file(sd, srcs / 'a.safetensors')
    cq.save_file({k: v for k, v in sd.items() if 'blocks' not in k or k.endswith('bias')}, srcs / 'b.safetensors')
    out = tmp_path / 'out'
    rc, text, err = cquant('quantize', str(srcs / '*.safetensors'), sharded.parent, out, '--preset', 'none',
                           '--no-sqnr', '--quiet')
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ['a.safetensors', 'b.safetensors', 'dit.safetensors']
    lines = text.splitlines()
    assert lines[0].split() == ['source', 'quantized', 'before', 'after', 'seconds', 'output'] and len(lines) == 5
    row = {l.split()[0]: l.split() for l in lines[2:]}
    n_a = len(quiet_quantize(srcs / 'a.safetensors', tmp_path / 'check.safetensors', Policy(preset='none'),
                             measure=False).quantized())
    assert row[str(srcs / 'a.safetensors')][1].split('/')[0] == str(n_a) and n_a > 0
    assert all(len(cq.load_file(out / f)) > 0 for f in os.listdir(out))
    rc, text, err = cquant('quantize', str(srcs / '*.safetensors'), out, '--report', tmp_path / 'r.json')
    assert rc == 1 and '--report and --plot take one source' in err
    rc, text, err = cquant('quantize', str(srcs / '*.nothing'), out)
    assert rc == 1 and 'expected files matching the pattern' in err
    (tmp_path / 'other').mkdir(); cq.save_file(sd, tmp_path / 'other' / 'a.safetensors')
    rc, text, err = cquant('quantize', srcs / 'a.safetensors', tmp_path / 'other' / 'a.safetensors', tmp_path / 'out2')
    assert rc == 1 and f"would all be written to '{tmp_path / 'out2' / 'a.safetensors'}'" in err and not (tmp_path / 'out2').exists()


def test_error_midway_leaves_no_folder(sharded, tmp_path, monkeypatch):
    import cquant.jobs as C
    calls, orig = [], C._quantize_layer
    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3: raise KeyboardInterrupt
        return orig(*a, **k)
    monkeypatch.setattr(C, '_quantize_layer', failing)
    with pytest.raises(KeyboardInterrupt):
        quiet_quantize(sharded, tmp_path / 'out', POL, measure=False, shard_size='200KB', hash_output=True)
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []


def test_convert_over_shards(sd, sharded, tmp_path):
    from cquant.jobs import convert_checkpoint
    r = convert_checkpoint(sharded.parent, tmp_path / 'c.safetensors')
    assert r['removed'] == [] and r['added'] == []
    back = cq.load_file(tmp_path / 'c.safetensors')
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    first = sorted(os.listdir(sharded.parent))[0]
    with pytest.raises(ValueError, match=f'is the source shard {first} file'):
        quiet_quantize(sharded, sharded.parent / first, POL)


def test_shards_filled_by_output_size_and_permissions(tmp_path):
    "Modules are placed by what they write (INT8: half the bf16 source), so two fit where the source had room for one."
    g = torch.Generator().manual_seed(0)
    sd = {f'b.{i}.fc.weight': torch.randn(512, 512, generator=g).to(torch.bfloat16) for i in range(4)}
    cq.save_file(sd, tmp_path / 'src.safetensors')
    out = tmp_path / 'out'
    quiet_quantize(tmp_path / 'src.safetensors', out, Policy('int8', preset='none'), measure=False, shard_size=600_000,
                   hash_output=True)
    doc = json.loads((out / 'model.safetensors.index.json').read_text())
    per = {}
    for k, f in doc['weight_map'].items(): per.setdefault(f, set()).add(k.split('.')[1])
    assert sorted(per) == ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    assert sorted(map(sorted, per.values())) == [['0', '1'], ['2', '3']]
    for f in per:
        assert sum(i.nbytes for i in read_header(out / f)[0].values()) <= 600_000
    umask = os.umask(0); os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((tmp_path / 'out.sha256').stat().st_mode & 0o777) == 0o666 & ~umask


def test_stale_shard_folder_of_a_killed_run_is_removed(sharded, tmp_path):
    "A run killed mid-write (SIGKILL) leaves its temporary shard folder; the next writer in that folder removes it."
    p = subprocess.Popen([sys.executable, '-c', 'pass']); p.wait()          # a pid that no longer runs
    from cquant.runtime import host_name
    stale = tmp_path / f'.out.cquant-{host_name()}-{p.pid}-abc123.shards'
    stale.mkdir(); (stale / 'part-00001.safetensors').write_bytes(b'x')
    mine = tmp_path / f'.other.cquant-{host_name()}-{os.getpid()}-abc123.shards'; mine.mkdir()    # a live run's: kept
    quiet_quantize(sharded, tmp_path / 'out', POL, measure=False, shard_size='1MB')
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted([mine.name, 'out'])
