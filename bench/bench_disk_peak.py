"""Disk-space peak of a save: `cquant quantize` on a synthetic bf16 checkpoint, with the bytes allocated in the
destination folder (temporary files + DST, `st_blocks`) sampled every millisecond while it runs.

    python bench/bench_disk_peak.py [--mb 256] [--dim 2048] [--mode int8] [--code DIR]

`--code DIR` runs the cquant of another checkout (e.g. the one before this change) on the same source.
Prints the peak, the output size, their ratio and (peak - output) / largest output tensor.
Target: 1.0x plus at most one tensor (the writer holds the output once; it used to hold a spool and a copy).
"""
from __future__ import annotations
import argparse, os, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def make_source(path, mb:int, dim:int) -> int:
    "A bf16 checkpoint of `mb` MB of [dim, dim] linear weights (plus biases); returns its size."
    import torch
    sys.path.insert(0, str(ROOT))
    from cquant.checkpoint import StreamingWriter
    g = torch.Generator().manual_seed(0)
    with StreamingWriter(path, {'source': 'bench_disk_peak synthetic'}, validate=False) as w:
        for i in range(max(1, mb * 2**20 // (2 * dim * dim))):
            w.add(f'blocks.{i}.lin.weight', torch.randn(dim, dim, generator=g).to(torch.bfloat16))
            w.add(f'blocks.{i}.lin.bias', torch.zeros(dim, dtype=torch.bfloat16))
    return os.path.getsize(path)

def used(d:str) -> int:
    "Bytes allocated by the files in folder `d`."
    n = 0
    for e in os.scandir(d):
        try: n += e.stat().st_blocks * 512
        except FileNotFoundError: pass
    return n

def run(src:str, out_dir:str, mode:str, code:str) -> tuple[int, int, int, float]:
    "Run `cquant quantize` from checkout `code`; (peak bytes in out_dir, output size, largest output tensor, seconds)."
    dst = os.path.join(out_dir, 'out.safetensors')
    env = {**os.environ, 'PYTHONPATH': code}
    t0 = time.time()
    p = subprocess.Popen([sys.executable, '-m', 'cquant.cli', 'quantize', src, dst, '--mode', mode, '--preset', 'none',
                          '--quiet', '--no-sqnr', '--json'], env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while p.poll() is None:
        peak = max(peak, used(out_dir)); time.sleep(0.001)
    secs = time.time() - t0
    assert p.returncode == 0, p.stderr.read().decode()
    sys.path.insert(0, str(ROOT))
    from cquant.checkpoint import read_header
    largest = max(i.nbytes for i in read_header(dst)[0].values())
    return max(peak, used(out_dir)), os.path.getsize(dst), largest, secs

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--mb', type=int, default=256, help='source size in MB (bf16)')
    ap.add_argument('--dim', type=int, default=2048, help='weights are [dim, dim]')
    ap.add_argument('--mode', default='int8', help='quantization mode (default int8: fast on CPU)')
    ap.add_argument('--code', action='append', help='checkout(s) whose cquant to run (default: this one); repeatable')
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix='cq_disk_') as d:
        src = os.path.join(d, 'src.safetensors')
        size = make_source(src, a.mb, a.dim)
        print(f'source {size / 2**20:.0f} MiB, mode {a.mode}, sampled every 1 ms')
        print(f"{'code':<40} {'output MiB':>10} {'peak MiB':>9} {'peak/out':>9} {'(peak-out)/largest':>19} {'s':>6}")
        for code in a.code or [str(ROOT)]:
            out = os.path.join(d, 'out'); os.makedirs(out)
            peak, n, largest, secs = run(src, out, a.mode, code)
            print(f'{code:<40} {n / 2**20:>10.1f} {peak / 2**20:>9.1f} {peak / n:>8.2f}x {(peak - n) / largest:>19.2f} {secs:>6.1f}')
            for f in os.listdir(out): os.unlink(os.path.join(out, f))
            os.rmdir(out)

if __name__ == '__main__': main()
