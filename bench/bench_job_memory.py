"""Peak memory of `quantize_checkpoint` against the largest tensor, as the job reports it (`Report.cost`: the peak RSS
over the RSS at the job's start, from the kernel's VmHWM), on synthetic bf16 sources (issue 37).

    python bench/bench_job_memory.py [--dim 3072] [--blocks 64] [--square] [--no-sqnr] [--repeats 3]

`--square`: one dim x dim linear per block (the issue's 3072x3072 case: 18 MiB each); otherwise a transformer block
(qkv 3dim x dim, proj, fc1 4dim x dim, fc2 dim x 4dim). Each repeat runs in a fresh process. The target is
peak <= 2 x the largest tensor + 32 MiB.
"""
import argparse, json, os, subprocess, sys, tempfile
from pathlib import Path

CHILD = r'''
import json, sys, warnings
warnings.simplefilter('ignore')
import torch, cquant as cq
from cquant.checkpoint import StreamingWriter
dim, blocks, square, measure, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1', sys.argv[4] == '1', sys.argv[5]
shapes = (('attn.proj', 1, 1),) if square else (('attn.qkv', 3, 1), ('attn.proj', 1, 1), ('mlp.fc1', 4, 1), ('mlp.fc2', 1, 4))
g, largest = torch.Generator().manual_seed(0), 0
with StreamingWriter(f'{d}/src.safetensors') as w:
    for b in range(blocks):
        for n, o, i in shapes:
            t = (torch.randn(o * dim, i * dim, generator=g) * 0.02).to(torch.bfloat16)
            largest = max(largest, t.numel() * 2)
            w.add(f'blocks.{b}.{n}.weight', t); w.add(f'blocks.{b}.{n}.bias', torch.zeros(o * dim, dtype=torch.bfloat16))
rep = cq.quantize_checkpoint(f'{d}/src.safetensors', f'{d}/q.safetensors', progress=False, measure=measure)
print(json.dumps(dict(largest=largest, **rep.cost)))
'''

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--dim', type=int, default=3072); ap.add_argument('--blocks', type=int, default=64)
    ap.add_argument('--square', action='store_true'); ap.add_argument('--no-sqnr', action='store_true')
    ap.add_argument('--repeats', type=int, default=3)
    a = ap.parse_args()
    root = str(Path(__file__).resolve().parents[1])
    for r in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            out = subprocess.run([sys.executable, '-c', CHILD, str(a.dim), str(a.blocks), str(int(a.square)),
                                  str(int(not a.no_sqnr)), d], capture_output=True, text=True, check=True,
                                 env={**os.environ, 'PYTHONPATH': root}).stdout
        c = json.loads(out.splitlines()[-1])
        peak, big = c['peak_rss_over_start'], c['largest']
        print(f"run {r + 1}: largest {big / 2**20:.1f} MiB; peak over the start {peak / 2**20:.1f} MiB = {peak / big:.2f}x "
              f"(target {(2 * big + (32 << 20)) / 2**20:.0f} MiB); {c['seconds']:.1f} s")

if __name__ == '__main__': main()
