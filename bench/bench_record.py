"""Issue 43's recorder and GPTQ-from-statistics targets, measured (not timed in tests).

    python bench/bench_record.py memory [--rows 100000] [--batch 4096] [--hessian-rows 1.0]   # memory and overhead of recording
    python bench/bench_record.py gptq [--layers proj,mlp2,linear2]      # GPTQ from statistics at FLUX-shaped layers
    python bench/bench_record.py share [--shares 1,0.5,0.25]            # what a Hessian on a share of the rows costs GPTQ
    python bench/bench_record.py flux [--n 16] [--tokens 256]           # the FLUX-shaped DiT: GPTQ from rows vs statistics
    python bench/bench_record.py select                                 # measured selection from a file, held out twice
    python bench/bench_record.py device [--device cuda] [--n 8] [--tokens 256] [--compare-cpu]   # the FLUX block on a GPU

`memory` runs a model of four linears at FLUX's widths (3072 -> 12288 -> 3072, twice: inputs of K = 3072 and 12288),
each setting in a fresh process: the forward alone, then the same forward recording every layer. It prints the
statistics' own size, the peak RSS of recording less that of the forward alone, their ratio (target <= 1.1), the
forward times and the overhead (target <= 50%), and the floor of that overhead: the Hessian's multiply-adds (K^2 per
row per layer) over the forward's (K*N), in full and on the upper blocks the recorder multiplies, times the share of
rows the Hessian sums (`--hessian-rows`, `record_calibration(hessian_rows=)`).

`gptq` times `cq.quantize(w, 'convrot_w4a4', rounding='gptq', calibration=stats)` at FLUX-shaped layers, against its
flop bound at this machine's measured fp32 GEMM rate: the Hessian rotated into the format's basis (two block-Hadamard
products, 4 K^2 g flops for rotation group g), its Cholesky factorisation (K^3 / 3) and the column sweep's error
updates (N K^2 between blocks, N K B inside blocks of B = 128 columns). The MSE search of the row scales (21 clips,
elementwise) is not in the bound. The time is the layer's second call in its process, as a layer of a model's loop
meets it (the first call, which also pays for fresh pages and lazy set-ups, is printed beside it). Peak memory is
reported in Hessians (K^2 fp32), from a process of its own run with MALLOC_MMAP_THRESHOLD_=131072 (which slows it)
so that freed blocks leave the RSS (without it glibc keeps them for reuse, and the peak RSS depends on what the
process freed before).

`share` records MiniLM with `hessian_rows` at each share (calibrated on 600 of the calibration sentences), quantizes
its real checkpoint `int4_full` with GPTQ from the saved file, and prints the SQNR gain over round-to-nearest held out
on EVAL_SENTENCES and on the other 135 calibration sentences; then the same for the DiT from the statistics.

`flux` quantizes the FLUX-shaped DiT of `cq.flux_model` (one double and one single block at FLUX's widths, bf16)
`int4_full` with GPTQ, calibrated from the rows (the row path) and from recorded statistics (all rows, a quarter),
and prints the held-out output SQNR of each against round-to-nearest.

`select` records MiniLM on 600 of the calibration sentences (with and without `sensitivity=True`), runs
`cquant quantize --mode int4_mixed --selection measured --calibration FILE` at ratios 0.2 and 0.5, and prints each
file's held-out hidden-state SQNR against the best and the median of every subset of the budget's candidates, on
EVAL_SENTENCES (A) and on the other 135 calibration sentences (B); and the time of the recordings.

`device` runs the FLUX-shaped DiT of `flux` (bf16, written as a checkpoint) on `--device`: records its statistics
there, saves them, and quantizes the checkpoint `int4_full` with GPTQ from that file through `quantize_checkpoint`
on the device (and with `--compare-cpu` on the CPU too); prints the times, the peak GPU memory, the held-out output
SQNR of each file against round-to-nearest and whether the two outputs are the same bytes (GPTQ's float sums run in
another order on a GPU, so they need not be).
"""
import argparse, atexit, json, os, re, shutil, subprocess, sys, tempfile, time
import torch
import torch.nn as nn

SHAPES = {'proj': (3072, 3072), 'mlp0': (12288, 3072), 'mlp2': (3072, 12288), 'linear2': (3072, 15360)}


def rss_peak() -> int:
    "Peak RSS since the last `reset_peak` (Linux's VmHWM)."
    with open('/proc/self/status') as f: return int(re.search(r'VmHWM:\s+(\d+) kB', f.read()).group(1)) * 1024


def reset_peak():
    "Start the peak RSS again from the current RSS, so that what ran before (building the inputs) is not counted."
    with open('/proc/self/clear_refs', 'w') as f: f.write('5')


def rss_now() -> int:
    with open('/proc/self/statm') as f: return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class FourLinears(nn.Module):
    "Two MLPs at FLUX's widths: the recorded inputs have K = 3072 (twice) and K = 12288 (twice)."
    def __init__(self, d=3072, h=12288):
        super().__init__()
        self.a0, self.a2, self.b0, self.b2 = nn.Linear(d, h), nn.Linear(h, d), nn.Linear(d, h), nn.Linear(h, d)
    def forward(self, x):
        x = x + self.a2(torch.relu(self.a0(x)))
        return x + self.b2(torch.relu(self.b0(x)))


def child(mode:str, rows:int, batch:int, share:float):
    "One measurement in this process: JSON with the peak above the baseline and the time."
    import cquant as cq
    torch.manual_seed(0)
    model = FourLinears().eval()
    g = torch.Generator().manual_seed(1)
    batches = lambda: (torch.randn(min(batch, rows - i), 3072, generator=g) for i in range(0, rows, batch))
    with torch.no_grad(): model(torch.randn(batch, 3072))     # warm up (allocator, threads) before the baseline
    reset_peak(); base = rss_now()
    t = time.perf_counter()
    if mode == 'forward':
        with torch.no_grad():
            for x in batches(): model(x)
        seconds, size = time.perf_counter() - t, 0
    else:
        st = cq.record_calibration(model, batches(), run=lambda m, x: m(x), hessian_rows=share)
        seconds = time.perf_counter() - t
        size = sum(s.gram().numel() * s.gram().element_size() + s.rows.numel() * 4 + s.K * (8 + 4) + 2048 * 8
                   for n, s in ((n, st[n]) for n in st))
    print(json.dumps(dict(mode=mode, seconds=seconds, peak_above_base=rss_peak() - base, stats_bytes=size)))


def memory(rows:int, batch:int, share:float):
    run = lambda mode: json.loads(subprocess.run([sys.executable, __file__, '_child', mode, str(rows), str(batch), str(share)],
                                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    fwd, rec = run('forward'), run('record')
    extra = rec['peak_above_base'] - fwd['peak_above_base']
    from cquant.record import HESSIAN_BLOCK
    upper = lambda K: (b := -(-K // HESSIAN_BLOCK)) * (b + 1) / 2 / b ** 2      # share of the blocks multiplied
    floor = share * (2 * 3072 ** 2 + 2 * 12288 ** 2) / (4 * 3072 * 12288)
    floor_upper = share * (2 * 3072 ** 2 * upper(3072) + 2 * 12288 ** 2 * upper(12288)) / (4 * 3072 * 12288)
    print(f"recording {rows} rows (batches of {batch}) into 4 layers (K = 3072, 12288, 3072, 12288), the Hessian on a "
          f"share {share:g} of them, torch threads {torch.get_num_threads()}:")
    print(f"  statistics' own size        {rec['stats_bytes'] / 1e9:.3f} GB")
    print(f"  peak RSS: recording less the forward alone {extra / 1e9:.3f} GB = {extra / rec['stats_bytes']:.3f}x the "
          f"statistics (target <= 1.1)")
    print(f"  forward alone {fwd['seconds']:.1f} s, recording {rec['seconds']:.1f} s: overhead "
          f"{rec['seconds'] / fwd['seconds'] - 1:+.0%} (target <= +50%; the Hessian's multiply-adds alone are "
          f"{floor:.0%} of the forward's, {floor_upper:.0%} on the blocks on and above the diagonal)")


def gemm_rate(n:int=3072, reps:int=7) -> float:
    "This machine's fp32 GEMM rate in flop/s: the best of `reps` n x n products (the bound is then the tightest)."
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float('inf')
    for _ in range(reps):
        t = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def gptq_child(name:str, what:str):
    "One layer's GPTQ from statistics in this process: JSON with its time (`what='time'`) or its peak memory above the start."
    import cquant as cq
    from cquant.runtime import trim_heap
    N, K = SHAPES[name]
    torch.manual_seed(0)
    w = torch.randn(N, K) / K ** 0.5
    s = cq.LayerStats(K, 0)
    for _ in range(2): s.update(torch.randn(2 * K, K) * torch.linspace(0.2, 2, K))
    s.gram()
    gptq = lambda: cq.quantize(w, 'convrot_w4a4', rounding='gptq', calibration=s)
    if what == 'memory':
        trim_heap()                  # the inputs' freed rows returned to the system: every later allocation is counted
        reset_peak(); base = rss_now()
        gptq()
        print(json.dumps(dict(peak_above_base=rss_peak() - base))); return
    times = []
    for _ in range(2):               # the first call (fresh pages, lazy set-ups), then one as a model's loop meets it
        t = time.perf_counter(); gptq(); times.append(time.perf_counter() - t)
    print(json.dumps(dict(cold=times[0], seconds=times[1])))


def gptq(layers):
    rate = gemm_rate()
    print(f"fp32 GEMM rate {rate / 1e9:.0f} GFLOP/s at {torch.get_num_threads()} threads; GPTQ (convrot_w4a4) from statistics:")
    for name in layers:
        N, K = SHAPES[name]
        run = lambda what, env: json.loads(subprocess.run([sys.executable, __file__, '_gptq', name, what], capture_output=True,
                                                          text=True, check=True, env=env).stdout.strip().splitlines()[-1])
        r = run('time', os.environ)                          # with the usual allocator
        r.update(run('memory', {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '131072'}))   # freed blocks leave the RSS
        flops = 4 * K ** 2 * 256 + K ** 3 / 3 + N * K ** 2 + N * K * 128
        print(f"  {name:8s} {N}x{K}: {r['seconds']:.2f} s (first call {r['cold']:.2f} s), bound {flops / rate:.2f} s "
              f"({flops:.2e} flops): {r['seconds'] / (flops / rate):.1f}x (target <= 3x); peak above the start "
              f"{r['peak_above_base'] / (K * K * 4):.1f} Hessians (target <= 3)")


def share(shares):
    "int4_full GPTQ from statistics whose Hessian sums a share of the rows: held-out SQNR gain over nearest."
    import tempfile, warnings
    from dataclasses import replace
    import cquant as cq
    from cquant.evaluate import Workload, CALIBRATION_SENTENCES, minilm_workload, dit_workload, evaluate
    warnings.simplefilter('ignore')
    split, tmp = 600, tempfile.mkdtemp(); atexit.register(shutil.rmtree, tmp, True)
    A = minilm_workload(calibration=CALIBRATION_SENTENCES[:split])           # held out: EVAL_SENTENCES
    B = replace(A, evaluation=cq.sentence_batches(CALIBRATION_SENTENCES[split:], 8), embed=None)   # and the other 135
    def quantized(rounding, calibration=None):
        out = os.path.join(tmp, f'{rounding}-{len(os.listdir(tmp))}.safetensors')
        cq.quantize_checkpoint(cq.minilm_path(), out, cq.Policy(mode='int4_full', rounding=rounding), progress=False,
                               measure=False, calibration=calibration)
        return out
    near = quantized('nearest')
    na, nb = evaluate(A, near)['sqnr_db'], evaluate(B, near)['sqnr_db']
    print(f"MiniLM int4_full, calibrated on {split} sentences, GPTQ from the recorded file; held out on EVAL_SENTENCES (A) "
          f"and the other {len(CALIBRATION_SENTENCES) - split} calibration sentences (B); nearest {na:.2f} / {nb:.2f} dB:")
    model = cq.minilm_model()
    for p in shares:
        st = cq.record_calibration(model, A.calibration, mask=lambda b: b[1], hessian_rows=p)
        f = quantized('gptq', st.save(os.path.join(tmp, f'cal-{p}.safetensors')))
        a, b = evaluate(A, f)['sqnr_db'], evaluate(B, f)['sqnr_db']
        first = st[next(iter(st))]
        print(f"  hessian_rows={p:<5g} {first.hessian_count:6d} of {first.count} rows: "
              f"A {a:.2f} dB ({a - na:+.2f}), B {b:.2f} dB ({b - nb:+.2f})")
    wl = dit_workload(n=32)
    pol, dn = cq.Policy(mode='int4_full', rounding='gptq'), evaluate(wl, cq.Policy(mode='int4_full'))['sqnr_db']
    print(f"DiT int4_full ({len(wl.calibration)} calibration batches), held out; nearest {dn:.2f} dB:")
    for p in shares:
        st = cq.record_calibration(wl.model(), wl.calibration, hessian_rows=p)
        d = evaluate(replace(wl, calibration=st), pol, calibrate=True)['sqnr_db']
        print(f"  hessian_rows={p:<5g}: {d:.2f} dB ({d - dn:+.2f})")


def flux(n:int, tokens:int):
    "The FLUX-shaped DiT (one double and one single block at FLUX's widths): GPTQ from rows against from statistics."
    import warnings
    from dataclasses import replace
    import cquant as cq
    from cquant.evaluate import Workload, evaluate
    warnings.simplefilter('ignore')
    mk = lambda k, seed: cq.flux_batches(k, img_tokens=tokens, seed=seed)
    wl = Workload('flux', lambda: cq.flux_model(0), mk(n, 1), mk(4, 2), lambda m, b: m(*b))
    pol = cq.Policy(mode='int4_full', rounding='gptq')
    near = evaluate(wl, cq.Policy(mode='int4_full'))['sqnr_db']
    print(f"FLUX-shaped DiT (1 double + 1 single block, hidden 3072), int4_full, {n} calibration batches of "
          f"{tokens} + 64 tokens, held out on 4 others; nearest {near:.2f} dB:")
    t = time.perf_counter(); r = evaluate(wl, pol, calibrate=True)['sqnr_db']
    print(f"  GPTQ from rows (Calibration(batches), up to 8192 rows a layer): {r:.2f} dB ({r - near:+.2f}), "
          f"{time.perf_counter() - t:.0f} s")
    for p in (1.0, 0.25):
        t = time.perf_counter(); st = cq.record_calibration(wl.model(), wl.calibration, hessian_rows=p)
        tr = time.perf_counter() - t; t = time.perf_counter()
        s = evaluate(replace(wl, calibration=st), pol, calibrate=True)['sqnr_db']
        print(f"  GPTQ from statistics, hessian_rows={p:g}: {s:.2f} dB ({s - near:+.2f}); recording {tr:.0f} s, "
              f"quantize and evaluate {time.perf_counter() - t:.0f} s")


def device_run(device:str, n:int, tokens:int, compare_cpu:bool, hidden:int=3072):
    "The FLUX-shaped DiT recorded and GPTQ-quantized from the statistics on `device` and on the CPU."
    import tempfile, warnings
    from safetensors.torch import save_file
    import cquant as cq
    from cquant.evaluate import Workload, evaluate
    from bench_checkpoint import sha256, differing
    warnings.simplefilter('ignore')
    tmp = tempfile.mkdtemp(); atexit.register(shutil.rmtree, tmp, True)
    mk = lambda k, seed: cq.flux_batches(k, img_tokens=tokens, seed=seed)
    wl = Workload('flux', lambda: cq.flux_model(0, hidden=hidden, heads=hidden // 128), mk(n, 1), mk(4, 2), lambda m, b: m(*b))
    model, src = wl.model(), os.path.join(tmp, 'flux.safetensors')
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, src)
    on = lambda b: tuple(t.to(device) if torch.is_tensor(t) else t for t in b)
    model.to(device)
    torch.cuda.reset_peak_memory_stats() if device.startswith('cuda') else None
    with torch.no_grad():
        for b in wl.calibration[:2]: model(*on(b))               # warm-up: kernels compiled, pages touched
        torch.cuda.synchronize() if device.startswith('cuda') else None
        t = time.perf_counter()
        for b in wl.calibration: model(*on(b))
        torch.cuda.synchronize() if device.startswith('cuda') else None
        fwd = time.perf_counter() - t
    t = time.perf_counter()
    st = cq.record_calibration(model, [on(b) for b in wl.calibration])
    torch.cuda.synchronize() if device.startswith('cuda') else None
    rec = time.perf_counter() - t
    stats = st.save(os.path.join(tmp, 'stats.safetensors'))
    model.cpu(); del st
    print(f"FLUX-shaped DiT on {device} ({torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}): "
          f"{n} batches of {tokens} + 64 tokens; forward {fwd:.2f} s, recording every linear {rec:.2f} s "
          f"({rec / fwd:.2f}x the forward); statistics {os.path.getsize(stats) / 2**20:.0f} MiB")
    pol, res = cq.Policy(mode='int4_full', rounding='gptq'), {}
    for dev in [device] + ['cpu'] * compare_cpu:
        dst = os.path.join(tmp, f'gptq-{dev}.safetensors')
        if dev.startswith('cuda'): torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        cq.quantize_checkpoint(src, dst, pol, progress=False, calibration=stats, device=dev)
        res[dev] = dict(seconds=time.perf_counter() - t, sha=sha256(dst), dst=dst,
                        gpu_peak=torch.cuda.max_memory_allocated() if dev.startswith('cuda') else None)
    near = os.path.join(tmp, 'nearest.safetensors')
    cq.quantize_checkpoint(src, near, cq.Policy(mode='int4_full'), progress=False, device=device)
    # held out on the device: each model loaded from its file on the CPU, then moved (`.to(device)`), as a user runs it
    ev = Workload('flux', wl.model, wl.calibration, wl.evaluation, lambda m, b: m.to(device)(*on(b)).float().cpu())
    try: dn = evaluate(ev, near)['sqnr_db']
    except Exception as e:
        print(f"  evaluating on {device} failed ({type(e).__name__}: {str(e)[:300]}); evaluating on the CPU")
        ev = wl; dn = evaluate(ev, near)['sqnr_db']
    for dev, r in res.items():
        db = evaluate(ev, r['dst'])['sqnr_db']
        print(f"  GPTQ from the statistics via quantize_checkpoint(device={dev!r}): {r['seconds']:.1f} s, held-out "
              f"{db:.2f} dB ({db - dn:+.2f} over nearest {dn:.2f})"
              + (f", peak GPU memory {r['gpu_peak'] / 2**20:.0f} MiB" if r['gpu_peak'] else ''))
    if compare_cpu:
        same = res[device]['sha'] == res['cpu']['sha']
        diff = [] if same else differing(res[device]['dst'], res['cpu']['dst'])
        print(f"  {device} / cpu time {res[device]['seconds'] / res['cpu']['seconds']:.2f}x; outputs "
              + ('identical' if same else f"differ in {len(diff)} of the entries: {diff[:6]}"))


def select():
    "int4_mixed measured selection through the CLI from recorded files, against every subset, held out on two sets."
    import tempfile, warnings
    from dataclasses import replace
    from itertools import combinations
    import cquant as cq
    from cquant.evaluate import CALIBRATION_SENTENCES, minilm_workload, evaluate, subset_scores
    warnings.simplefilter('ignore')
    split, tmp = 600, tempfile.mkdtemp(); atexit.register(shutil.rmtree, tmp, True)
    A = minilm_workload(calibration=CALIBRATION_SENTENCES[:split])
    B = replace(A, evaluation=cq.sentence_batches(CALIBRATION_SENTENCES[split:], 8), embed=None)
    model, files = cq.minilm_model(), {}
    with torch.no_grad():
        t = time.perf_counter()
        for b in A.calibration: model(*b)
    print(f"forward alone over the {split} sentences: {time.perf_counter() - t:.1f} s")
    for sens in (False, True):
        t = time.perf_counter()
        st = cq.record_calibration(model, A.calibration, mask=lambda b: b[1], sensitivity=sens)
        print(f"recording {split} sentences, sensitivity={sens}: {time.perf_counter() - t:.1f} s")
        files[sens] = st.save(os.path.join(tmp, f'cal-{sens}.safetensors'))
    pol = cq.Policy(mode='int4_mixed', selection='measured')
    cands = sorted(replace(pol, int4_mixed_ratio=1.0).plan(model).budget['chosen'])
    short = lambda s: '+'.join(c.split('.')[2] for c in sorted(s))
    for ratio in (0.2, 0.5):
        p = replace(pol, int4_mixed_ratio=ratio)
        subsets = list(combinations(cands, p.plan(model).budget['target']))
        scores = {w: dict(zip(subsets, subset_scores(wl, p, subsets))) for w, wl in (('A', A), ('B', B))}
        print(f"ratio {ratio}: " + '; '.join(f"{w} best {short(max(sc, key=sc.get))} {max(sc.values()):.2f} dB, "
                                              f"median {sorted(sc.values())[len(sc) // 2]:.2f}" for w, sc in scores.items()))
        for sens, f in files.items():
            out = os.path.join(tmp, f'q-{ratio}-{sens}.safetensors')
            subprocess.run([sys.executable, '-m', 'cquant.cli', 'quantize', cq.minilm_path(), out, '--mode', 'int4_mixed',
                            '--selection', 'measured', '--ratio', str(ratio), '--calibration', f, '--quiet'], check=True,
                           capture_output=True)
            with cq.open_checkpoint(out) as ck:
                kept = {n for n in cands if ck.modules()[n].format != 'convrot_w4a4'}
            db = {w: evaluate(wl, out)['sqnr_db'] for w, wl in (('A', A), ('B', B))}
            line = '; '.join(f"{w} {v:.2f} dB ({v - max(scores[w].values()):+.2f})" for w, v in db.items())
            print(f"  {'Hessian and sensitivity' if sens else 'Hessian alone':24s} keeps {short(kept)}: {line}")


if __name__ == '__main__':
    if sys.argv[1:2] == ['_child']: child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])); sys.exit()
    if sys.argv[1:2] == ['_gptq']: gptq_child(*sys.argv[2:4]); sys.exit()
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('what', choices=('memory', 'gptq', 'share', 'flux', 'select', 'device'))
    p.add_argument('--device', default='cuda')
    p.add_argument('--compare-cpu', action='store_true')
    p.add_argument('--hidden', type=int, default=3072, help="device: the model's width (smaller: a quick check of the script)")
    p.add_argument('--rows', type=int, default=100_000)
    p.add_argument('--batch', type=int, default=4096)
    p.add_argument('--layers', default='proj,mlp2,linear2')
    p.add_argument('--hessian-rows', type=float, default=1.0)
    p.add_argument('--shares', default='1,0.5,0.25')
    p.add_argument('--n', type=int, default=16)
    p.add_argument('--tokens', type=int, default=256)
    a = p.parse_args()
    if a.what == 'memory': memory(a.rows, a.batch, a.hessian_rows)
    elif a.what == 'gptq': gptq(a.layers.split(','))
    elif a.what == 'share': share([float(v) for v in a.shares.split(',')])
    elif a.what == 'select': select()
    elif a.what == 'device': device_run(a.device, a.n, a.tokens, a.compare_cpu, a.hidden)
    else: flux(a.n, a.tokens)
