"""Digest of what every format writes, to show a refactor leaves the bytes alone (issue 41: hash before, hash after).

    python tools/format_hashes.py before.json      # on the old tree
    python tools/format_hashes.py after.json       # on the new one
    cmp before.json after.json

It quantizes seeded weights (three shapes, bf16 and fp32) with every registered format, under its default options,
its study variants and every other value of each choice or bool option, by rounding 'nearest', 'mse' and 'gptq'
(calibrated formats with inputs), and writes one checkpoint per policy mode; each entry is a blake2b digest of the
state dict (names, dtypes, shapes, bytes), or the error it raised. Deterministic: one torch thread, fixed seeds."""
import hashlib, json, sys, tempfile, warnings
from pathlib import Path
import torch
import cquant as cq
from safetensors.torch import load_file, save_file
from cquant.policy import MODES


def digest(sd:dict) -> str:
    "blake2b of a state dict's names, dtypes, shapes and bytes (first 16 hex digits)."
    h = hashlib.blake2b()
    for k in sorted(sd):
        t = sd[k].contiguous()
        h.update(k.encode()); h.update(str(t.dtype).encode()); h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def option_sets(spec) -> list:
    "Default options, the study variants, and each other value of every option with choices or of type bool."
    sets = [{}] + [dict(v) for _, v in spec.study_variants]
    for o in spec.options:
        if o.choices: sets += [{o.name: c} for c in o.choices if c != o.default]
        elif o.type is bool: sets.append({o.name: not o.default})
    return sets


def attempt(fn) -> str:
    try: return fn()
    except Exception as e: return f'ERR {type(e).__name__}: {str(e)[:80]}'


def main(out:str):
    torch.set_num_threads(1)
    warnings.simplefilter('ignore')
    g, got = torch.Generator().manual_seed(0), {}
    for name, spec in cq.FORMATS.items():
        for opts in option_sets(spec):
            for shape in ((64, 256), (48, 512), (32, 1024)):
                for dt in (torch.bfloat16, torch.float32):
                    w, x = (torch.randn(shape, generator=g) * 0.05).to(dt), torch.randn(96, shape[1], generator=g).to(dt)
                    for rnd in ('nearest', 'mse', 'gptq'):
                        cal = x if rnd == 'gptq' or spec.declares('calibrated') else None
                        key = f"{name}|{json.dumps(opts, sort_keys=True, default=str)}|{shape}|{dt}|{rnd}"
                        got[key] = attempt(lambda: digest(cq.quantize(w, name, rounding=rnd, calibration=cal, **opts).state_dict('m.')))
    d = Path(tempfile.mkdtemp())
    sd = {f'blocks.{i}.{n}.weight': (torch.randn(s, generator=g) * 0.05).bfloat16() for i in range(2)
          for n, s in (('q', (256, 256)), ('ff', (512, 256)), ('out', (256, 512)), ('odd', (96, 200)))}
    sd['blocks.0.q.bias'] = torch.randn(256, generator=g).bfloat16()
    save_file(sd, str(d / 'src.safetensors'))
    for mode in MODES:
        dst = d / f'{mode}.safetensors'
        got[f'ckpt|{mode}'] = attempt(lambda: (cq.quantize_checkpoint(d / 'src.safetensors', dst, cq.Policy(mode=mode), progress=False),
                                              digest(load_file(str(dst))))[1])
    Path(out).write_text(json.dumps(got, indent=0, sort_keys=True))
    print(f"{len(got)} entries ({sum(v.startswith('ERR') for v in got.values())} errors) -> {out}")


if __name__ == '__main__': main(sys.argv[1])
