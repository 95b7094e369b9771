"""GPTQ that sees the runtime activations (issue 17): held-out output SQNR of each GPTQ variant, MiniLM and DiT.

    OMP_NUM_THREADS=1 python bench/bench_gptq_runtime.py [modes, default int4_full] [workloads, default minilm,dit]

Variants: nearest; gptq (float inputs, the default); gptq with `activations=` 'runtime' / 'asymmetric' / 'noise'
(`cquant.rounding.gptq_rounding`); 'sequential': `Calibration(batches, sequential=True)` (each GPTQ layer on its
inputs in the model with the earlier layers already quantized), with float and with runtime activations."""
import sys, time, warnings, functools, dataclasses
import torch
from cquant.tensor import register_rounding
from cquant.rounding import gptq_rounding
from cquant.calibrate import Calibration
from cquant.evaluate import minilm_workload, dit_workload, evaluate
from cquant.policy import Policy

VARIANTS = ('nearest', 'gptq', 'runtime', 'asymmetric', 'noise', 'sequential', 'sequential runtime')


def variant(wl, mode: str, v: str) -> float:
    "Held-out output SQNR (dB) of `mode` with GPTQ variant `v` (calibrated, as `cq.evaluate(calibrate=True)`)."
    if v == 'nearest': return evaluate(wl, Policy(mode=mode), calibrate=True)['sqnr_db']
    act = v.split()[-1] if v not in ('gptq', 'sequential') else 'float'
    if v.startswith('sequential'): wl = dataclasses.replace(wl, calibration=Calibration(wl.calibration, sequential=True))
    register_rounding('gptq', functools.partial(gptq_rounding, activations=act))
    try: return evaluate(wl, Policy(mode=mode, rounding='gptq').plan(wl.model()), calibrate=True)['sqnr_db']
    finally: register_rounding('gptq', gptq_rounding)


if __name__ == '__main__':
    modes = sys.argv[1].split(',') if len(sys.argv) > 1 else ['int4_full']
    wls = sys.argv[2].split(',') if len(sys.argv) > 2 else ['minilm', 'dit']
    torch.set_grad_enabled(False)
    warnings.simplefilter('ignore')
    print('| workload | mode | ' + ' | '.join(VARIANTS) + ' |\n|---|---|' + '---:|' * len(VARIANTS))
    for wn in wls:
        wl = minilm_workload() if wn == 'minilm' else dit_workload()
        for mode in modes:
            t = time.time()
            r = [variant(wl, mode, v) for v in VARIANTS]
            print(f"| {wn} | {mode} | " + ' | '.join(f'{x:.2f}' for x in r) + f' |   <!-- {time.time() - t:.0f} s -->',
                  flush=True)
