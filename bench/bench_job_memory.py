"""Peak memory of `quantize_checkpoint` against the largest tensor, as the job reports it (`Report.cost`: the peak RSS
over the RSS at the job's start, from the kernel's VmHWM), on synthetic bf16 sources (issue 37).

    python bench/bench_job_memory.py [--cases s4,s18,t72] [--mode int4_mixed] [--no-sqnr] [--repeats 3] [--code DIR]

The cases, by their largest tensor: `s4` 64 linears of 2048x1024 (4 MiB), `s18` 64 of 3072x3072 (18 MiB, the issue's
1.13 GiB file), `t72` two transformer blocks of width 3072 (qkv, proj, fc1 12288x3072 = 72 MiB, fc2). Each source is
written once by a process of its own; each repeat runs the job in a fresh process, as the CLI does. The target is
peak <= 2 x the largest tensor + 32 MiB. `--code DIR` runs the job with another checkout's cquant (an A/B).
"""
import argparse, json, os, subprocess, sys, tempfile
from pathlib import Path

CASES = {'s4': ((('attn.proj', 2048, 1024),), 64), 's18': ((('attn.proj', 3072, 3072),), 64),
         't72': ((('attn.qkv', 9216, 3072), ('attn.proj', 3072, 3072), ('mlp.fc1', 12288, 3072), ('mlp.fc2', 3072, 12288)), 2)}

MAKE = r'''
import json, sys, torch
from cquant.checkpoint import StreamingWriter
shapes, blocks, path = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
with StreamingWriter(path) as w:
    for b in range(blocks):
        for n, o, i in shapes:
            w.add(f'blocks.{b}.{n}.weight', (torch.randn(o, i, generator=g) * 0.02).to(torch.bfloat16))
            w.add(f'blocks.{b}.{n}.bias', torch.zeros(o, dtype=torch.bfloat16))
'''

JOB = r'''
import json, sys, warnings
warnings.simplefilter('ignore')
import cquant as cq
src, dst, mode, measure = sys.argv[1:5]
rep = cq.quantize_checkpoint(src, dst, cq.Policy(mode=mode), progress=False, measure=measure == '1')
print(json.dumps(rep.cost))
'''

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--cases', default='s4,s18,t72'); ap.add_argument('--mode', default='int4_mixed')
    ap.add_argument('--no-sqnr', action='store_true'); ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--code', default=str(Path(__file__).resolve().parents[1]), help='the checkout whose cquant runs')
    a = ap.parse_args()
    a.code = os.path.abspath(a.code)
    env = {**os.environ, 'PYTHONPATH': a.code}      # run there too: `python -c` puts the working directory first
    run = lambda code, *args: subprocess.run([sys.executable, '-c', code, *map(str, args)], capture_output=True, text=True,
                                             check=True, env=env, cwd=a.code).stdout
    for case in a.cases.split(','):
        shapes, blocks = CASES[case]
        big = max(o * i * 2 for _, o, i in shapes)
        with tempfile.TemporaryDirectory() as d:
            run(MAKE, json.dumps(shapes), blocks, f'{d}/src.safetensors')
            for r in range(a.repeats):
                c = json.loads(run(JOB, f'{d}/src.safetensors', f'{d}/q.safetensors', a.mode, int(not a.no_sqnr)).splitlines()[-1])
                peak = c['peak_rss_over_start']
                print(f"{case} {a.mode} run {r + 1}: largest {big / 2**20:.1f} MiB; peak over the start {peak / 2**20:.1f} MiB = "
                      f"{peak / big:.2f}x (target {(2 * big + (32 << 20)) / 2**20:.0f} MiB); {c['seconds']:.2f} s")

if __name__ == '__main__': main()
