"""Peak memory and time of the attention references at long sequences (issue 19).

Usage: python bench/bench_attention.py [--t 8192 2048] [--heads 8] [--kitchen-t 2048]

Each measurement runs in a fresh process: it builds bf16 (B=1, T, H, D=128) Q/K/V, reads its resident memory,
calls the method once, and reports the peak resident memory added by that call (`getrusage` high-water mark minus
the resident memory before the call) and the call's wall time (one cold call; then the best of 2 more for T <= 2048).
`cq.sol_attention` is chunked over query blocks; kitchen's eager `sol_attn` (run only at --kitchen-t, it holds
several (B, H, T, T) fp32 tensors) is the unchunked reference.
"""
import argparse, json, os, subprocess, sys

CHILD = r'''
import json, resource, sys, time, torch
method, t, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if method == 'cquant':
    import cquant as cq; fn = cq.sol_attention
else:
    from comfy_kitchen.backends.eager.sol_attn import sol_attn as fn
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, t, h, 128, generator=g).bfloat16() for _ in range(3))
def rss_kib():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS:'))
before = rss_kib()
t0 = time.perf_counter(); out = fn(q, k, v, tau=1.0); first = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
best = first
if t <= 2048:
    for _ in range(2):
        t0 = time.perf_counter(); fn(q, k, v, tau=1.0); best = min(best, time.perf_counter() - t0)
print(json.dumps(dict(method=method, t=t, h=h, extra_mib=(peak - before) / 1024, first_s=first, best_s=best)))
'''


def measure(method:str, t:int, h:int) -> dict:
    r = subprocess.run([sys.executable, '-c', CHILD, method, str(t), str(h)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    if r.returncode: sys.exit(f'{method} T={t}: failed\n{r.stderr[-2000:]}')
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--t', type=int, nargs='+', default=[8192, 2048])
    ap.add_argument('--heads', type=int, default=8)
    ap.add_argument('--kitchen-t', type=int, nargs='*', default=[2048])
    a = ap.parse_args()
    import torch
    print(f'# {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 B=1 H={a.heads} D=128, tau=1')
    print('| method | T | extra peak memory | time (first call) | time (best) |\n|---|---|---|---|---|')
    runs = [('cquant', t) for t in a.t] + [('kitchen', t) for t in a.kitchen_t]
    for method, t in runs:
        r = measure(method, t, a.heads)
        name = 'cq.sol_attention' if method == 'cquant' else "kitchen's eager sol_attn"
        print(f"| {name} | {t} | {r['extra_mib']:.0f} MiB | {r['first_s']:.2f} s | {r['best_s']:.2f} s |", flush=True)
