"""Whole-checkpoint quantization: throughput and peak memory of `cquant.quantize_checkpoint` on a synthetic
bf16 checkpoint of at least 2 GB (a Flux-like stack of transformer blocks, dim 3072) with `int4_mixed`.

    python bench/bench_checkpoint.py [--gb 2.0] [--dim 3072] [--mode int4_mixed] [--no-sqnr] [--dir DIR] [--keep]

1. The source file is written tensor by tensor (`StreamingWriter`), so generating it never holds the model.
2. The conversion runs in a fresh child process, which reports its resident set before converting
   (interpreter + torch + cquant: the baseline) and its peak (`VmHWM`; `ru_maxrss` would include the
   parent's peak, which Linux carries across fork + exec) after.
3. Prints throughput (source GB per second of wall time), the peak RSS, the largest tensor, and
   (peak - baseline) / largest tensor. Target: peak RSS < 3 x largest tensor + baseline.
Writes bench/out/checkpoint.json. Timings on a shared machine are noisy; the memory ratio is not.
"""
from __future__ import annotations
import argparse, json, os, platform, resource, shutil, subprocess, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant
import torch

BLOCK = (('attn.qkv', 3, 1), ('attn.proj', 1, 1), ('mlp.fc1', 4, 1), ('mlp.fc2', 1, 4), ('modulation.lin', 6, 1))   # (name, out/dim, in/dim)

def _hwm() -> int:
    "Peak resident set size of this process image in bytes (VmHWM; unlike ru_maxrss, not inherited across fork + exec)."
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))

def _rss_now() -> int:
    "Current resident set size in bytes (Linux)."
    with open('/proc/self/statm') as f: return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')

def make_source(path:str, gb:float, dim:int) -> dict:
    "Write a synthetic bf16 checkpoint of at least `gb` GB; returns its size, tensor count and largest tensor."
    from cquant.convert import StreamingWriter
    per_block = sum(o * i * dim * dim * 2 + o * dim * 2 for _, o, i in BLOCK)
    blocks = max(1, -(-int(gb * 1e9) // per_block))
    g = torch.Generator().manual_seed(0)
    largest = total = n = 0
    with StreamingWriter(path, {'source': f'bench_checkpoint synthetic: {blocks} blocks, dim {dim}, bf16'}, validate=False) as w:
        for b in range(blocks):
            for name, o, i in BLOCK:
                wt = torch.randn(o * dim, i * dim, generator=g, dtype=torch.float32).mul_((i * dim) ** -0.5).to(torch.bfloat16)
                if name == 'mlp.fc2': wt[:, torch.randperm(i * dim, generator=g)[:8]] *= 12      # a few outlier input columns
                w.add(f'blocks.{b}.{name}.weight', wt)
                w.add(f'blocks.{b}.{name}.bias', torch.zeros(o * dim, dtype=torch.bfloat16))
                largest = max(largest, wt.numel() * 2); total += (wt.numel() + o * dim) * 2; n += 2
                del wt
    return dict(blocks=blocks, tensors=n, tensor_bytes=total, file_bytes=os.path.getsize(path), largest_tensor_bytes=largest)

def child(src:str, dst:str, mode:str, sqnr:bool):
    "Run in a fresh process: baseline RSS, convert, peak RSS."
    import cquant
    from cquant.convert import quantize_checkpoint
    from cquant.policy import Policy
    base = _rss_now()
    cpu = lambda: sum(getattr(resource.getrusage(resource.RUSAGE_SELF), k) for k in ('ru_utime', 'ru_stime'))
    t0, c0 = time.perf_counter(), cpu()
    rep = quantize_checkpoint(src, dst, Policy(mode, preset='none'), progress=True, measure=sqnr)
    dt, dc = time.perf_counter() - t0, cpu() - c0
    peak = _hwm()
    print(json.dumps(dict(seconds=dt, cpu_seconds=dc, load_avg=os.getloadavg()[0], baseline_rss=base, peak_rss=peak, dst_bytes=os.path.getsize(dst),
                          formats={k: v['layers'] for k, v in rep.totals['formats'].items()},
                          sqnr_db=rep.totals['sqnr_db'] if sqnr else None, threads=torch.get_num_threads())))

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--gb', type=float, default=2.0, help='source size in GB (1e9 bytes), at least')
    ap.add_argument('--dim', type=int, default=3072, help='model width (K of most linears; a multiple of 256)')
    ap.add_argument('--mode', default='int4_mixed')
    ap.add_argument('--no-sqnr', action='store_true', help='skip the per-layer SQNR (one dequantize per weight)')
    ap.add_argument('--dir', default=None, help='where to write the files (default: a temporary folder)')
    ap.add_argument('--keep', action='store_true', help='keep the files')
    ap.add_argument('--child', nargs=4, metavar=('SRC', 'DST', 'MODE', 'SQNR'), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child: return child(a.child[0], a.child[1], a.child[2], a.child[3] == '1')
    d = a.dir or tempfile.mkdtemp(prefix='cq_bench_ckpt_')
    os.makedirs(d, exist_ok=True)
    src, dst = os.path.join(d, 'synthetic_bf16.safetensors'), os.path.join(d, f'synthetic_{a.mode}.safetensors')
    try:
        t0 = time.perf_counter()
        info = make_source(src, a.gb, a.dim)
        print(f"source: {info['file_bytes'] / 1e9:.2f} GB, {info['tensors']} tensors ({info['blocks']} blocks, dim {a.dim}), "
              f"largest tensor {info['largest_tensor_bytes'] / 2**20:.1f} MiB; written in {time.perf_counter() - t0:.1f} s", flush=True)
        out = subprocess.run([sys.executable, __file__, '--child', src, dst, a.mode, '0' if a.no_sqnr else '1'],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        L, base, peak = info['largest_tensor_bytes'], r['baseline_rss'], r['peak_rss']
        res = dict(machine=dict(cpus=os.cpu_count(), torch=torch.__version__, python=platform.python_version(), threads=r['threads']),
                   mode=a.mode, sqnr=not a.no_sqnr, **info, **r, throughput_gb_s=info['file_bytes'] / 1e9 / r['seconds'],
                   ratio_peak_minus_baseline_to_largest=(peak - base) / L, target_met=peak < 3 * L + base)
        print(f"{a.mode}: {info['file_bytes'] / 1e9:.2f} GB -> {r['dst_bytes'] / 1e9:.2f} GB in {r['seconds']:.1f} s = "
              f"{res['throughput_gb_s']:.3f} GB/s ({os.cpu_count()} CPUs, {r['threads']} torch threads, load average {r['load_avg']:.1f})"
              f"{'' if a.no_sqnr else ', per-layer SQNR on'}; CPU time {r['cpu_seconds']:.1f} s = {info['file_bytes'] / 1e9 / r['cpu_seconds']:.3f} GB per CPU-second")
        print(f"layers: {r['formats']}" + (f", aggregate SQNR {r['sqnr_db']:.2f} dB" if r['sqnr_db'] is not None else ''))
        print(f"RSS: baseline {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; largest tensor {L / 2**20:.1f} MiB; "
              f"(peak - baseline) / largest = {res['ratio_peak_minus_baseline_to_largest']:.2f}; "
              f"peak / largest = {peak / L:.2f}; target peak < 3 x largest + baseline: {'met' if res['target_met'] else 'NOT met'}")
        outdir = Path(__file__).resolve().parent / 'out'
        outdir.mkdir(exist_ok=True)
        (outdir / 'checkpoint.json').write_text(json.dumps(res, indent=1))
    finally:
        if not a.keep:
            if a.dir: [os.unlink(p) for p in (src, dst) if os.path.exists(p)]
            else: shutil.rmtree(d, ignore_errors=True)

if __name__ == '__main__':
    main()
