"""Provenance in every output header (cquant version, policy, the sources' names, sizes and SHA-256 computed in
the one streaming read, a per-layer summary), shown by `cquant inspect`; `hash_output` / `--hash-output`."""
import hashlib, json, os, subprocess, sys, threading, time, warnings
from pathlib import Path

import pytest
import torch

import cquant as cq
from cquant._version import __version__
from cquant.checkpoint import format_inspect, inspect_checkpoint, open_checkpoint, read_header
from cquant.jobs import quantize_checkpoint
from cquant.models import dit_state_dict
from cquant.policy import Policy, PolicyWarning
from conftest import cquant_cli as cquant
from test_shards import POL, write_shards


def sha(p) -> str: return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def quiet_quantize(*a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        return quantize_checkpoint(*a, progress=False, **k)


@pytest.fixture(scope='module')
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp('prov') / 'dit.safetensors'
    cq.save_file(dit_state_dict(1, torch.bfloat16, depth=1), p, {'source': 'test'})
    return p


def test_header_records_version_policy_sources_summary(src, tmp_path):
    dst = tmp_path / 'q.safetensors'
    rep = quiet_quantize(src, dst, POL, measure=False)
    meta = read_header(dst)[1]
    assert meta['cquant_version'] == __version__ and meta['cquant_policy'] == POL.to_json() and meta['source'] == 'test'
    assert json.loads(meta['cquant_sources']) == [dict(name='dit.safetensors', size=os.path.getsize(src), sha256=sha(src))]
    s = json.loads(meta['cquant_summary'])
    assert s['layers'] == len(rep.layers) and s['quantized'] == len(rep.quantized()) > 0
    assert s['bytes_before'] == rep.totals['bytes_before'] and s['bytes_after'] == rep.totals['bytes_after']
    per = {}
    for r in rep.layers: per[r['format'] or 'float'] = per.get(r['format'] or 'float', 0) + 1
    assert {f: v['layers'] for f, v in s['formats'].items()} == per
    assert sum(v['bytes'] for v in s['formats'].values()) == sum(r['bytes_after'] for r in rep.layers)
    text = format_inspect(inspect_checkpoint(dst))
    assert f"made by cquant {__version__}" in text and f"source dit.safetensors: {os.path.getsize(src):,} bytes, sha256 {sha(src)}" in text


def test_hash_is_the_whole_file_whatever_was_read(src):
    "The hash covers the file even when reads skip tensors, go out of order or repeat."
    with open_checkpoint(src) as ck:
        keys = ck.file_order()
        ck.start_hashing()
        for k in keys[::-3] + keys[1::2] + keys[:2]: ck[k]
        assert ck.file_hashes()[0]['sha256'] == sha(src)


def _settled(h, expected:int) -> int:
    "The hash thread's byte count once it reaches `expected` (or stops moving for a second)."
    for _ in range(100):
        if h.hashed >= expected: break
        time.sleep(0.01)
    return h.hashed


def test_hash_thread_reads_ahead_by_at_most_ahead(src):
    "The hash thread runs `ahead` bytes past the reads and waits there; finishing reads the rest, each byte once."
    with open_checkpoint(src) as ck:
        keys = ck.file_order()
        ck.start_hashing(ahead=4096)
        h = ck._hash
        assert _settled(h, 4096) == 4096
        ck[keys[0]]
        end = ck.info(keys[0]).offsets[1]
        assert _settled(h, end + 4096) == end + 4096
        assert h.is_alive() and h.name == 'cquant-hash'
        assert ck.file_hashes()[0]['sha256'] == sha(src) and h.hashed == os.path.getsize(src)
    with open_checkpoint(src) as ck:
        ck.start_hashing(ahead=0); h = ck._hash
    assert not h.is_alive()                         # close() ends a waiting hash thread


def test_stream_reads_each_source_byte_once(src, tmp_path, monkeypatch):
    "quantize_checkpoint reads each tensor once in file order; the hash thread reads each file byte once, ahead of it."
    import cquant.checkpoint as C
    hashed, reads = [], []
    orig_finish, orig_read = C._FileHasher.finish, C.Checkpoint._read
    def finish(self): r = orig_finish(self); hashed.append(self.hashed); return r
    def read(self, key, i): reads.append((threading.current_thread().name, key)); return orig_read(self, key, i)
    monkeypatch.setattr(C._FileHasher, 'finish', finish)
    monkeypatch.setattr(C.Checkpoint, '_read', read)
    quiet_quantize(src, tmp_path / 'q.safetensors', POL, measure=False)
    assert hashed == [os.path.getsize(src)]
    with open_checkpoint(src) as ck: big = [k for k in ck.file_order() if ck.info(k).nbytes > 1024]
    got = [k for _, k in reads if k in big]                  # small entries (JSON, scales) are also read by the scan
    assert sorted(got) == sorted(big)                        # each tensor read once
    for t in {t for t, _ in reads}:                          # the reader thread reads the quantized weights ahead,
        mine = [k for n, k in reads if n == t and k in big]   # the main thread the rest: each thread in file order
        assert mine == [k for k in big if k in mine], t


def test_sharded_source_hashes_every_shard(tmp_path):
    sd = dit_state_dict(2, torch.bfloat16, depth=1)
    idx = write_shards(tmp_path / 'm', sd, 2)
    quiet_quantize(idx.parent, tmp_path / 'q.safetensors', POL, measure=False)
    got = json.loads(read_header(tmp_path / 'q.safetensors')[1]['cquant_sources'])
    files = [idx] + [idx.parent / f for f in dict.fromkeys(json.loads(idx.read_text())['weight_map'].values())]
    assert got == [dict(name=f.name, size=os.path.getsize(f), sha256=sha(f)) for f in files]


def test_hash_output(src, tmp_path):
    dst = tmp_path / 'q.safetensors'
    quiet_quantize(src, dst, POL, measure=False, hash_output=True)
    assert (tmp_path / 'q.safetensors.sha256').read_text() == f"{sha(dst)}  q.safetensors\n"
    out = tmp_path / 'shards'
    quiet_quantize(src, out, POL, measure=False, hash_output=True, shard_size='1MB')
    lines = (tmp_path / 'shards.sha256').read_text().splitlines()
    names = sorted(os.listdir(out))
    assert len(lines) == len(names) > 2
    assert sorted(lines) == sorted(f"{sha(out / n)}  shards/{n}" for n in names)
    r = subprocess.run(['sha256sum', '-c', 'shards.sha256'], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count(': OK') == len(names)
    for n in names[:-1]:
        assert json.loads(read_header(out / n)[1]['cquant_sources'])[0]['sha256'] == sha(src)


@pytest.mark.long
def test_cli_hash_output_and_inspect(src, tmp_path):
    rc, out, err = cquant('quantize', src, tmp_path / 'c.safetensors', '--preset', 'none', '--no-sqnr', '--quiet',
                          '--hash-output')
    assert rc == 0, err
    assert f"wrote {tmp_path / 'c.safetensors'}, {tmp_path / 'c.safetensors'}.sha256" in out
    assert (tmp_path / 'c.safetensors.sha256').read_text().split() == [sha(tmp_path / 'c.safetensors'), 'c.safetensors']
    rc, out, err = cquant('inspect', tmp_path / 'c.safetensors', '--json')
    assert rc == 0, err
    p = json.loads(out)['provenance']
    assert p['cquant_version'] == __version__ and p['cquant_sources'][0]['sha256'] == sha(src)
    assert p['cquant_summary']['quantized'] > 0
