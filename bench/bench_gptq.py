"""rounding='mse' / 'gptq' (cquant.rounding): time per layer and for the MiniLM model, against round-to-nearest.

    python bench/bench_gptq.py [--shapes 384x384 1536x384 384x1536 4096x4096] [--rows 512] [--repeats 3] [--no-model]

Per layer: a randn weight and `--rows` calibration rows (seed 0); each of nearest / mse / gptq timed as the best of
`--repeats` runs of `cq.quantize` (the Hessian and its inverse included in gptq). Then the whole MiniLM encoder
(real weights: `cquant fetch-minilm`) through `cq.quantize_model` with `Policy(mode=..., rounding=...)` and the
harness's `CALIBRATION_SENTENCES` (735). Prints seconds and the ratio to nearest; writes bench/out/gptq.json.
"""
from __future__ import annotations
import argparse, json, os, platform, sys, time, warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant

FORMATS = (('convrot_w4a4', {'convrot_groupsize': 64}), ('int8_tensorwise', {'convrot': True, 'convrot_groupsize': 64}),
           ('nvfp4', {}))


def best(fn, repeats: int) -> float:
    t_best = float('inf')
    for _ in range(repeats):
        t = time.perf_counter(); fn(); t_best = min(t_best, time.perf_counter() - t)
    return t_best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--shapes', nargs='+', default=['384x384', '1536x384', '384x1536', '4096x4096'])
    ap.add_argument('--rows', type=int, default=512)
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--no-model', action='store_true', help='skip the MiniLM model timing')
    ap.add_argument('--out', default=str(Path(__file__).resolve().parent / 'out' / 'gptq.json'))
    args = ap.parse_args(argv)
    import cquant as cq
    torch.set_grad_enabled(False)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    rows = []
    print(f"{'layer':>10} {'format':<16} {'nearest s':>10} {'mse s':>8} {'gptq s':>8} {'mse/near':>9} {'gptq/near':>10}")
    for shape in args.shapes:
        N, K = map(int, shape.split('x'))
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(N, K, generator=g), torch.randn(args.rows, K, generator=g)
        for fmt, opts in FORMATS:
            t = {r: best(lambda: cq.quantize(w, fmt, rounding=r, **(dict(calibration=x) if r == 'gptq' else {}), **opts),
                         args.repeats) for r in ('nearest', 'mse', 'gptq')}
            rows.append(dict(shape=shape, format=fmt, **t))
            print(f"{shape:>10} {fmt:<16} {t['nearest']:10.3f} {t['mse']:8.3f} {t['gptq']:8.3f} "
                  f"{t['mse'] / t['nearest']:9.0f}x {t['gptq'] / t['nearest']:9.0f}x")
    model_rows = []
    if not args.no_model and cq.minilm_path():
        batches = cq.sentence_batches(cq.CALIBRATION_SENTENCES, 8)
        for mode in ('int4_full', 'nvfp4'):
            t = {}
            for r in ('nearest', 'mse', 'gptq'):
                with warnings.catch_warnings():
                    warnings.simplefilter('ignore', UserWarning)
                    plan = cq.Policy(mode=mode, rounding=r).plan(cq.minilm_model())
                    t[r] = best(lambda: cq.quantize_model(cq.minilm_model(), plan, calibration=batches), 1)
            model_rows.append(dict(model='minilm', mode=mode, **t))
            print(f"MiniLM {mode:<10} quantize_model: nearest {t['nearest']:.2f} s, mse {t['mse']:.2f} s, "
                  f"gptq {t['gptq']:.2f} s (calibration included in all three)")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(layers=rows, models=model_rows), indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())
