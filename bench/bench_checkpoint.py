"""Whole-checkpoint quantization: throughput and peak memory of `cquant.quantize_checkpoint` on a synthetic
bf16 checkpoint of at least 2 GB (a Flux-like stack of transformer blocks, dim 3072) with `int4_mixed`, against the
same job done through comfy-kitchen's layouts in a loop (the peer).

    python bench/bench_checkpoint.py [--gb 2.0] [--dim 3072] [--mode int4_mixed] [--no-sqnr] [--device cpu|cuda]
                                     [--no-peer] [--sqnr-cost] [--repeats N] [--dir DIR] [--keep] [--compare-cpu]

1. The source file is written tensor by tensor (`StreamingWriter`), so generating it never holds the model.
2. Each conversion runs in a fresh child process, which reports its resident set before converting
   (interpreter + torch + cquant: the baseline) and its peak (`VmHWM`; `ru_maxrss` would include the
   parent's peak, which Linux carries across fork + exec) after.
3. The peer: read each tensor (safetensors `safe_open`), quantize the layers cquant's plan quantizes with kitchen's
   layout for the same format (`QuantizedTensor.from_float`), with per-layer SQNR from kitchen's `dequantize` when SQNR
   is on, keep the results and write them with `safetensors.torch.save_file` (kitchen has no streaming writer).
4. Prints throughput (source GB per second of wall time) and as a fraction of this machine's memcpy bandwidth (a
   256 MiB clone, best of 3), the peak RSS, the largest tensor, (peak - baseline) / largest tensor, and the
   cquant / kitchen throughput ratio. Targets (issue 20): >= 0.25 GB/s with per-layer SQNR on, the SQNR costing <= 25%
   extra time (`--sqnr-cost` runs the job a second time without it and prints the ratio), and
   (peak RSS - baseline) <= 2 x the largest tensor.
With `--device cuda` the child also reports the peak GPU memory (`torch.cuda.max_memory_allocated`), and
`--compare-cpu` runs the same job on the CPU and compares the two outputs' SHA-256 (the files must be identical byte
for byte; if not, the tensors that differ are listed). Writes bench/out/checkpoint.json (or `--out`). Timings on a shared machine are noisy (the same run varies by 20-30% on a 2-core
virtual machine); `--repeats N` runs each cquant setting N times, alternating, and reports the median run. The memory
ratio is not noisy.
"""
from __future__ import annotations
import argparse, json, math, os, platform, resource, shutil, subprocess, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_quantize's kitchen rows
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
    from cquant.jobs import StreamingWriter
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

def memcpy_gb_s() -> float:
    "This machine's memory copy bandwidth in GB/s (read + write counted once): a 256 MiB clone, best of 3."
    x, best = torch.empty(1 << 28, dtype=torch.uint8).fill_(1), float('inf')
    for _ in range(3):
        t = time.perf_counter(); y = x.clone(); best = min(best, time.perf_counter() - t); del y
    return x.numel() / best / 1e9

def _kitchen_row(fmt:str, options:dict):
    "bench_quantize's row (kitchen layout and keywords) for a cquant format and options."
    from bench_quantize import ROWS
    rows = [r for r in ROWS if r.fmt == fmt and all(options.get(k) == v for k, v in r.opts.items())]
    if not rows: raise SystemExit(f"no kitchen layout known for {fmt} {options} (bench_quantize.ROWS)")
    return max(rows, key=lambda r: len(r.opts))

def kitchen_job(src:str, dst:str, mode:str, sqnr:bool, device:str) -> dict:
    "The same conversion through kitchen's layouts in a loop; returns the aggregate SQNR (or None)."
    from safetensors import safe_open
    from safetensors.torch import save_file
    from comfy_kitchen.tensor import QuantizedTensor as KQT
    import cquant as cq
    from cquant.policy import Policy
    plan = Policy(mode, preset='none').plan(src)
    out, sig, noise = {}, 0.0, 0.0
    with safe_open(src, 'pt') as f:
        for key in f.keys():
            m, _, s = key.rpartition('.')
            d = plan.get(m)
            if d is None or not d.format or s != 'weight': out[key] = f.get_tensor(key); continue
            w = f.get_tensor(key).to(device)
            r = _kitchen_row(d.format, d.options)
            kt = KQT.from_float(w, r.k_layout, **r.k_kw)
            out.update({k: t.cpu() for k, t in kt.state_dict(key).items()})
            out[m + '.comfy_quant'] = cq.encode_json({'format': d.format})
            if sqnr:
                e = w.float() - kt.dequantize().float()
                sig += float(w.float().square().sum(dtype=torch.float64)); noise += float(e.square().sum(dtype=torch.float64))
    save_file(out, dst)
    return None if not sqnr else 10 * math.log10(sig / noise)

def child(src:str, dst:str, mode:str, sqnr:bool, job:str, device:str):
    "Run in a fresh process: baseline RSS, convert (cquant or the kitchen peer), peak RSS."
    import cquant
    from cquant.jobs import quantize_checkpoint
    from cquant.policy import Policy
    base = _rss_now()
    cpu = lambda: sum(getattr(resource.getrusage(resource.RUSAGE_SELF), k) for k in ('ru_utime', 'ru_stime'))
    t0, c0 = time.perf_counter(), cpu()
    if job == 'kitchen': formats, db = None, kitchen_job(src, dst, mode, sqnr, device)
    else:
        if job == 'kernels':
            from cquant.kernels import dispatch
            dispatch.enable(strict=True)
        rep = quantize_checkpoint(src, dst, Policy(mode, preset='none'), progress=True, measure=sqnr, device=device)
        formats, db = {k: v['layers'] for k, v in rep.totals['formats'].items()}, rep.totals['sqnr_db'] if sqnr else None
    dt, dc = time.perf_counter() - t0, cpu() - c0
    peak = _hwm()
    gpu = dict(gpu_peak_bytes=torch.cuda.max_memory_allocated(), gpu=torch.cuda.get_device_name()) if device.startswith('cuda') else {}
    print(json.dumps(dict(seconds=dt, cpu_seconds=dc, load_avg=os.getloadavg()[0], baseline_rss=base, peak_rss=peak,
                          dst_bytes=os.path.getsize(dst), formats=formats, sqnr_db=db, threads=torch.get_num_threads(), **gpu)))

def sha256(path:str) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        while b := f.read(1 << 24): h.update(b)
    return h.hexdigest()

def differing(a:str, b:str) -> list:
    """Keys whose tensors (or presence) differ between two safetensors files, with how many of their bytes differ,
    and 'header metadata' if that does."""
    from safetensors import safe_open
    with safe_open(a, 'pt') as fa, safe_open(b, 'pt') as fb:
        out = ['header metadata'] if fa.metadata() != fb.metadata() else []
        for k in sorted(set(fa.keys()) | set(fb.keys())):
            if k not in fa.keys() or k not in fb.keys(): out.append(k); continue
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape: out.append(k); continue
            n = int((x.reshape(-1).view(torch.uint8) != y.reshape(-1).view(torch.uint8)).sum())
            if n: out.append(f'{k} ({n} of {x.numel() * x.element_size()} bytes)')
    return out

def _median(runs:list) -> dict:
    "The run of median wall time, with every run's seconds."
    return dict(sorted(runs, key=lambda r: r['seconds'])[len(runs) // 2], all_seconds=[round(r['seconds'], 2) for r in runs])

def _run(job:str, src:str, dst:str, a) -> dict:
    out = subprocess.run([sys.executable, __file__, '--child', src, dst, a.mode, '0' if a.no_sqnr else '1', job, a.device],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--gb', type=float, default=2.0, help='source size in GB (1e9 bytes), at least')
    ap.add_argument('--dim', type=int, default=3072, help='model width (K of most linears; a multiple of 256)')
    ap.add_argument('--mode', default='int4_mixed')
    ap.add_argument('--no-sqnr', action='store_true', help='skip the per-layer SQNR (one dequantize per weight)')
    ap.add_argument('--dir', default=None, help='where to write the files (default: a temporary folder)')
    ap.add_argument('--keep', action='store_true', help='keep the files')
    ap.add_argument('--device', default='cpu', help="where the weights are quantized (cuda: the GPU path)")
    ap.add_argument('--no-peer', action='store_true', help="skip the kitchen peer run")
    ap.add_argument('--sqnr-cost', action='store_true', help="also run without SQNR and print what the SQNR costs")
    ap.add_argument('--repeats', type=int, default=1, help="cquant runs per setting, alternating; the median is reported")
    ap.add_argument('--kernels', action='store_true', help="register cquant's Triton kernels as fast paths (a GPU)")
    ap.add_argument('--compare-cpu', action='store_true', help="also run the job on the CPU and compare the outputs' bytes")
    ap.add_argument('--out', default=str(Path(__file__).resolve().parent / 'out' / 'checkpoint.json'))
    ap.add_argument('--child', nargs=6, metavar=('SRC', 'DST', 'MODE', 'SQNR', 'JOB', 'DEVICE'), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child: return child(*a.child[:3], a.child[3] == '1', *a.child[4:])
    d = a.dir or tempfile.mkdtemp(prefix='cq_bench_ckpt_')
    os.makedirs(d, exist_ok=True)
    src, dst = os.path.join(d, 'synthetic_bf16.safetensors'), os.path.join(d, f'synthetic_{a.mode}.safetensors')
    peer_dst = os.path.join(d, f'synthetic_{a.mode}_kitchen.safetensors')
    try:
        t0 = time.perf_counter()
        info = make_source(src, a.gb, a.dim)
        print(f"source: {info['file_bytes'] / 1e9:.2f} GB, {info['tensors']} tensors ({info['blocks']} blocks, dim {a.dim}), "
              f"largest tensor {info['largest_tensor_bytes'] / 2**20:.1f} MiB; written in {time.perf_counter() - t0:.1f} s", flush=True)
        cost_on = a.sqnr_cost and not a.no_sqnr
        a_off, ons, offs = argparse.Namespace(**{**vars(a), 'no_sqnr': True}), [], []
        for _ in range(max(1, a.repeats)):
            ons.append(_run('kernels' if a.kernels else 'cquant', src, dst, a))
            if cost_on: offs.append(_run('cquant', src, dst, a_off))
        r = dict(_median(ons), memcpy_gb_s=memcpy_gb_s())
        L, base, peak = info['largest_tensor_bytes'], r['baseline_rss'], r['peak_rss']
        gbs = info['file_bytes'] / 1e9 / r['seconds']
        res = dict(machine=dict(cpus=os.cpu_count(), torch=torch.__version__, python=platform.python_version(), threads=r['threads']),
                   mode=a.mode, sqnr=not a.no_sqnr, device=a.device, kernels=a.kernels, **info, **r, throughput_gb_s=gbs,
                   fraction_of_memcpy=gbs / r['memcpy_gb_s'],
                   ratio_peak_minus_baseline_to_largest=(peak - base) / L, target_met=peak - base <= 2 * L)
        print(f"{a.mode}: {info['file_bytes'] / 1e9:.2f} GB -> {r['dst_bytes'] / 1e9:.2f} GB in {r['seconds']:.1f} s = "
              f"{gbs:.3f} GB/s = {res['fraction_of_memcpy']:.3f} of memcpy ({r['memcpy_gb_s']:.1f} GB/s) on {a.device}{' (Triton kernels)' if a.kernels else ''} "
              f"({os.cpu_count()} CPUs, {r['threads']} torch threads, load average {r['load_avg']:.1f})"
              f"{'' if a.no_sqnr else ', per-layer SQNR on'}; CPU time {r['cpu_seconds']:.1f} s = {info['file_bytes'] / 1e9 / r['cpu_seconds']:.3f} GB per CPU-second"
              + (f"; median of {len(ons)} runs: {r['all_seconds']} s" if len(ons) > 1 else ''))
        print(f"layers: {r['formats']}" + (f", aggregate SQNR {r['sqnr_db']:.2f} dB" if r['sqnr_db'] is not None else ''))
        print(f"RSS: baseline {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; largest tensor {L / 2**20:.1f} MiB; "
              f"(peak - baseline) / largest = {res['ratio_peak_minus_baseline_to_largest']:.2f}; "
              f"peak / largest = {peak / L:.2f}; target peak - baseline <= 2 x largest: {'met' if res['target_met'] else 'NOT met'}")
        if cost_on:
            off = _median(offs)
            res['no_sqnr'] = dict(off, throughput_gb_s=info['file_bytes'] / 1e9 / off['seconds'])
            cost = r['seconds'] / off['seconds'] - 1
            runs = f"; median of {len(offs)} runs: {off['all_seconds']} s" if len(offs) > 1 else ''
            print(f"without SQNR: {off['seconds']:.1f} s = {res['no_sqnr']['throughput_gb_s']:.3f} GB/s (CPU time "
                  f"{off['cpu_seconds']:.1f} s{runs}); "
                  f"the per-layer SQNR costs {cost * 100:+.0f}% time (target <= +25%)")
        if a.compare_cpu:
            cpu_dst = os.path.join(d, f'synthetic_{a.mode}_cpu.safetensors')
            c = _run('cquant', src, cpu_dst, argparse.Namespace(**{**vars(a), 'device': 'cpu'}))
            hashes = sha256(dst), sha256(cpu_dst)
            diff = [] if hashes[0] == hashes[1] else differing(dst, cpu_dst)
            res['cpu'] = dict(c, throughput_gb_s=info['file_bytes'] / 1e9 / c['seconds'], sha256=hashes[1])
            res.update(sha256=hashes[0], identical_to_cpu=hashes[0] == hashes[1], differing_from_cpu=diff)
            os.unlink(cpu_dst)
            print(f"CPU path: {c['seconds']:.1f} s = {res['cpu']['throughput_gb_s']:.3f} GB/s; {a.device} / CPU throughput "
                  f"{gbs / res['cpu']['throughput_gb_s']:.2f}x; outputs {'identical' if not diff else 'DIFFER'} "
                  f"(sha256 {hashes[0][:16]} vs {hashes[1][:16]})" + (f"; {len(diff)} entries differ: {diff[:8]}" if diff else ''))
        if 'gpu_peak_bytes' in r:
            print(f"peak GPU memory {r['gpu_peak_bytes'] / 2**20:.0f} MiB = {r['gpu_peak_bytes'] / L:.2f}x the largest tensor ({r['gpu']})")
        if not a.no_peer:
            k = _run('kitchen', src, peer_dst, a)
            res['kitchen'] = dict(k, throughput_gb_s=info['file_bytes'] / 1e9 / k['seconds'])
            print(f"kitchen's layouts in a loop: {k['seconds']:.1f} s = {res['kitchen']['throughput_gb_s']:.3f} GB/s"
                  + (f", aggregate SQNR {k['sqnr_db']:.2f} dB" if k['sqnr_db'] is not None else '')
                  + f", peak RSS {k['peak_rss'] / 2**20:.0f} MiB; cquant / kitchen throughput: {gbs / res['kitchen']['throughput_gb_s']:.2f}x")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    finally:
        if not a.keep:
            if a.dir: [os.unlink(p) for p in (src, dst, peer_dst) if os.path.exists(p)]
            else: shutil.rmtree(d, ignore_errors=True)

if __name__ == '__main__':
    main()
