"""Durability of `cquant quantize`: runs killed (SIGKILL, SIGTERM, SIGINT) at several moments of the write,
concurrent runs into one DST, and a write that hits a file-size limit.

Each run is a real `cquant` process (`cquant.cli.main`) on a ~5 MB synthetic checkpoint. The killed runs slow
the writer down by 5 ms per write (a wrapper patches `StreamingWriter._write`), so the signal lands while the
temporary file is being written, not after the rename. The full-disk case uses `RLIMIT_FSIZE`, which gives
EFBIG ("File too large"), not ENOSPC: the same error path (`DiskFullError`), a different errno; ENOSPC itself is
simulated in-process in nbs/11_checkpoint.ipynb."""
import hashlib, os, resource, signal, subprocess, sys, time
import pytest, torch
import cquant as cq
from cquant.models import dit_state_dict

pytestmark = pytest.mark.long     # real processes, killed at chosen moments: seconds each

SLOW = ("import sys, time, cquant.checkpoint as c; w = c.StreamingWriter._write; "
        "c.StreamingWriter._write = lambda s, t: (time.sleep(0.005), w(s, t))[1]; "
        "from cquant.cli import main; sys.exit(main(sys.argv[1:]))")
ENV = {**os.environ, 'PYTHONPATH': os.getcwd(), 'PYTHONDONTWRITEBYTECODE': '1'}

def _args(src, dst): return ['quantize', str(src), str(dst), '--preset', 'none', '--quiet', '--no-sqnr']
def _spawn(src, dst, slow=True, before=lambda: None):
    "The run, started as from a terminal (a pytest-xdist worker ignores SIGINT, and its children would), `before` in the child."
    cmd = [sys.executable, '-c', SLOW] if slow else [sys.executable, '-m', 'cquant.cli']
    def child(): signal.signal(signal.SIGINT, signal.SIG_DFL); before()
    return subprocess.Popen(cmd + _args(src, dst), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=child)
def _temps(d, dst): return sorted(p for p in os.listdir(d) if p.startswith('.' + os.path.basename(dst) + '.'))
def _sha(p): return hashlib.sha256(p.read_bytes()).hexdigest()

@pytest.fixture(scope='module')
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp('durable')
    src = d / 'src.safetensors'
    cq.save_file(dit_state_dict(0, torch.bfloat16, depth=1), src)
    ref = d / 'ref.safetensors'
    p = _spawn(src, ref, slow=False); out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return d, src, ref.read_bytes(), _sha(src)

def _wait(p, d, dst, at:int, timeout=20.0):
    "Poll until the run's temporary file holds at least `at` bytes (0: exists at all)."
    t0 = time.time()
    while time.time() - t0 < timeout:
        for n in _temps(d, dst):
            try:
                if os.path.getsize(d / n) > at or (at == 0 and os.path.exists(d / n)): return n
            except FileNotFoundError: pass
        assert p.poll() is None, f'the run ended before the kill point: {p.communicate()}'
        time.sleep(0.002)
    raise AssertionError('kill point never reached')

KILLS = [(signal.SIGKILL, 'first_bytes'), (signal.SIGKILL, 'late'), (signal.SIGTERM, 'created'), (signal.SIGTERM, 'late'),
         (signal.SIGINT, 'first_bytes'), (signal.SIGINT, 'late')]

@pytest.mark.parametrize('sig,when', KILLS, ids=[f'{s.name}-{w}' for s, w in KILLS])
def test_killed_run(work, sig, when):
    "DST keeps its previous bytes, SRC is unchanged, TERM/INT leave no temporary file and end in one line."
    d, src, ref, src_sha = work
    dst = d / f'dst_{sig.name}_{when}.safetensors'
    dst.write_bytes(b'previous')
    p = _spawn(src, dst)
    _wait(p, d, dst, {'created': 0, 'first_bytes': 1, 'late': len(ref) * 6 // 10}[when])
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert dst.read_bytes() == b'previous' and _sha(src) == src_sha
    if sig == signal.SIGKILL:
        assert p.returncode == -9
        left = _temps(d, dst)
        assert len(left) == 1 and f'.cquant-' in left[0] and f'-{p.pid}-' in left[0], left    # names DST and the process
    else:
        assert (p.returncode, err.splitlines()[-1]) == ((143, 'cquant quantize: terminated') if sig == signal.SIGTERM
                                                       else (130, 'cquant quantize: interrupted')), err
        assert 'Traceback' not in err and 'Exception ignored' not in err, err
        assert _temps(d, dst) == []
    if sig == signal.SIGKILL and when == 'late':         # the next run removes what the killed one left
        p = _spawn(src, dst, slow=False); out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert dst.read_bytes() == ref and _temps(d, dst) == []

def test_concurrent_runs(work):
    "Two runs into one DST at once: both succeed, DST is a whole output, nothing is left behind."
    d, src, ref, src_sha = work
    dst = d / 'both.safetensors'
    ps = [_spawn(src, dst) for _ in range(2)]
    res = [p.communicate(timeout=60) for p in ps]
    assert [p.returncode for p in ps] == [0, 0], res
    assert dst.read_bytes() == ref and _temps(d, dst) == [] and _sha(src) == src_sha

def _fsize_limit(n):
    def f(): resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return f

def test_file_size_limit(work):
    "A write past RLIMIT_FSIZE (EFBIG) fails in one line naming DST and the bytes needed; DST and SRC untouched."
    d, src, ref, src_sha = work
    dst = d / 'limited.safetensors'
    dst.write_bytes(b'previous')
    p = _spawn(src, dst, slow=False, before=_fsize_limit(len(ref) // 2))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    line = err.splitlines()[-1]
    assert line.startswith(f'cquant quantize: error: {dst}: File too large while writing its temporary file '
                           f'.{dst.name}.cquant-'), line
    assert 'the file needs at least ' in line and ' bytes free in ' in line, line
    assert dst.read_bytes() == b'previous' and _temps(d, dst) == [] and _sha(src) == src_sha

def test_report_never_overwrites(work):
    "`--report` naming SRC or DST (through a symlink too) is refused before anything is written."
    d, src, ref, src_sha = work
    dst = d / 'rep.safetensors'
    os.symlink(src, d / 'src_link.safetensors')
    for report, what in ((d / 'src_link.safetensors', 'SRC'), (dst, 'DST')):
        r = subprocess.run([sys.executable, '-m', 'cquant.cli', *_args(src, dst), '--report', str(report)],
                           capture_output=True, text=True, env=ENV, timeout=60)
        assert r.returncode == 1 and f"the --report '{report}' is the {what} file" in r.stderr, r.stderr
    assert _sha(src) == src_sha and not dst.exists() and _temps(d, dst) == []
