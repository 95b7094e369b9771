"""Quantize / dequantize speed of cquant vs comfy-kitchen eager on one 4096x4096 bf16 weight.

    python bench/bench_quantize.py [--shape 4096 4096] [--dtype bf16] [--outliers 8] [--repeats 3] [--stat median]
                                   [--tolerance 0.05] [--strict]

For every row of `ROWS` (a format plus options, and the kitchen layout that makes the same tensor), in one process:
warm up once, then take the median (or the best, `--stat best`) of `--repeats` rounds (time.perf_counter; cquant and
kitchen timed back to back in each round) of quantize and of dequantize, for cquant
(`cq.quantize`, `QuantizedTensor.dequantize`) and for kitchen (`QuantizedTensor.from_float`, `.dequantize`). Prints a
table with seconds and the ratio kitchen/cquant (> 1 means cquant is faster) and writes bench/out/quantize.json.
Rows whose format cquant has not registered yet are listed as skipped.

To add a format, add one line to `ROWS`.
"""
from __future__ import annotations
import argparse, json, os, platform, statistics, sys, time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant

@dataclass(frozen=True)
class Row:
    id: str                                  # row label
    fmt: str                                 # cquant format name
    opts: dict = field(default_factory=dict) # cq.quantize options
    k_layout: str = ""                       # kitchen layout registry name (QuantizedTensor.from_float)
    k_kw: dict = field(default_factory=dict) # kitchen Layout.quantize keyword arguments


ROWS = [
    Row("float8_e4m3fn",     "float8_e4m3fn",   {},                                            "TensorCoreFP8Layout",  {"dtype": torch.float8_e4m3fn}),
    Row("float8_e5m2",       "float8_e5m2",     {},                                            "TensorCoreFP8Layout",  {"dtype": torch.float8_e5m2}),
    Row("nvfp4",             "nvfp4",           {},                                            "TensorCoreNVFP4Layout", {}),
    Row("mxfp8",             "mxfp8",           {},                                            "TensorCoreMXFP8Layout", {}),
    Row("int8_tensorwise",   "int8_tensorwise", {},                                            "TensorWiseINT8Layout", {}),
    Row("int8_per_row",      "int8_tensorwise", {"per_row": True},                             "TensorWiseINT8Layout", {"per_channel": True}),
    Row("int8_convrot16",    "int8_tensorwise", {"convrot": True, "convrot_groupsize": 16},    "TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 16}),
    Row("int8_convrot64",    "int8_tensorwise", {"convrot": True, "convrot_groupsize": 64},    "TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 64}),
    Row("int8_convrot256",   "int8_tensorwise", {"convrot": True, "convrot_groupsize": 256},   "TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 256}),
    Row("convrot_w4a4",      "convrot_w4a4",    {},                                            "TensorCoreConvRotW4A4Layout", {}),
    Row("asym_w4a8_int8",    "asym_w4a8_int8",  {},                                            "AsymW4A8Int8Layout",   {}),
    Row("w6a8_int8",         "w6a8_int8",       {},                                            "AsymW4A8Int8Layout",   {"bits": 6}),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timed(fn: Callable) -> tuple:
    "(wall seconds, CPU seconds of this process) of one call of `fn`."
    t, c = time.perf_counter(), time.process_time(); fn()
    return time.perf_counter() - t, time.process_time() - c


def bench_row(row: Row, w: torch.Tensor, repeats: int, stat: Callable = min) -> dict:
    """Warm up once, then `repeats` rounds; each round times cquant and kitchen back to back (so a load spike on a
    shared machine hits both), and each timing keeps `stat` (min or median) of its rounds. Wall time (perf_counter)
    is the measure; CPU time (process_time, all threads) is recorded too, as it is less sensitive to other processes."""
    import cquant as cq
    from comfy_kitchen.tensor import QuantizedTensor as KQT
    spec = cq.FORMATS[row.fmt]
    opts = spec.resolve(None, **row.opts)
    cq_q = lambda: cq.quantize(w, row.fmt, **row.opts)
    cq_layout_q = lambda: spec.layout.quantize(w, **opts)   # without cq.quantize's input checks
    ck_q = lambda: KQT.from_float(w, row.k_layout, **row.k_kw)
    qt, kt = cq_q(), ck_q()                       # warm-up (also the tensors the dequantize timings use)
    qt.dequantize(); kt.dequantize(); cq_layout_q()
    fns = dict(cquant_quantize=cq_q, kitchen_quantize=ck_q, cquant_dequantize=qt.dequantize,
               kitchen_dequantize=kt.dequantize, cquant_layout_quantize=cq_layout_q)
    walls = {k: [] for k in fns}; cpus = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            tw, tc = timed(fn); walls[k].append(tw); cpus[k].append(tc)
    wall = {k: stat(v) for k, v in walls.items()}; cpu = {k: stat(v) for k, v in cpus.items()}
    out = dict(id=row.id, format=row.fmt, options=row.opts, **{k + "_s": v for k, v in wall.items()},
               **{k + "_cpu_s": v for k, v in cpu.items()})
    for op in ("quantize", "dequantize"):
        out[op + "_ratio"] = out[f"kitchen_{op}_s"] / out[f"cquant_{op}_s"]
        out[op + "_cpu_ratio"] = out[f"kitchen_{op}_cpu_s"] / out[f"cquant_{op}_cpu_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(4096, 4096))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stat", choices=("median", "best"), default="median", help="statistic of the rounds")
    ap.add_argument("--outliers", type=int, default=8, help="input columns scaled x12 (outlier columns); 0: plain randn")
    ap.add_argument("--tolerance", type=float, default=0.05, help="ratio >= 1 - tolerance counts as no slower (timing noise)")
    ap.add_argument("--only", nargs="*", help="row ids to run")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "quantize.json"))
    ap.add_argument("--strict", action="store_true", help="exit 1 if cquant is slower for some format")
    args = ap.parse_args(argv)

    import cquant as cq
    from importlib.metadata import version as _version
    torch.manual_seed(0)
    w = torch.randn(*args.shape, dtype=torch.float32)
    if args.outliers: w[:, torch.randperm(args.shape[1])[:args.outliers]] *= 12
    w = w.to(DTYPES[args.dtype])
    stat = statistics.median if args.stat == "median" else min
    rows, skipped = [], []
    for row in ROWS:
        if args.only and row.id not in args.only: continue
        if row.fmt not in cq.FORMATS: skipped.append(row.id); continue
        rows.append(bench_row(row, w, args.repeats, stat))

    floor = 1.0 - args.tolerance
    hdr = (f"{'format':<18} {'cq quant':>9} {'ck quant':>9} {'ratio':>6}   {'cq deq':>8} {'ck deq':>8} {'ratio':>6}"
           f"   {'cq layout q':>11}")
    print(f"quantize / dequantize of a {args.shape[0]}x{args.shape[1]} {args.dtype} weight ({args.outliers} outlier "
          f"columns x12), {args.stat} of {args.repeats}, "
          f"seconds; ratio = kitchen / cquant (> 1: cquant faster); torch threads {torch.get_num_threads()}")
    print("cq layout q = the layout's quantize alone, without cq.quantize's option resolution and finiteness check;"
          " cpu ratios (process_time) in the JSON")
    print(hdr); print("-" * len(hdr))
    for r in rows:
        flag = "" if min(r["quantize_ratio"], r["dequantize_ratio"]) >= floor else "  <- cquant slower"
        print(f"{r['id']:<18} {r['cquant_quantize_s']:>9.4f} {r['kitchen_quantize_s']:>9.4f} {r['quantize_ratio']:>6.2f}   "
              f"{r['cquant_dequantize_s']:>8.4f} {r['kitchen_dequantize_s']:>8.4f} {r['dequantize_ratio']:>6.2f}"
              f"   {r['cquant_layout_quantize_s']:>11.4f}{flag}")
    if skipped: print(f"skipped (not registered in cquant yet): {', '.join(skipped)}")

    slower = [f"{r['id']} ({op} {r[op + '_ratio']:.2f})" for r in rows for op in ("quantize", "dequantize") if r[op + "_ratio"] < floor]
    ok = bool(rows) and not slower
    out = Path(args.out); out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        shape=list(args.shape), dtype=args.dtype, outliers=args.outliers, repeats=args.repeats, stat=args.stat,
        tolerance=args.tolerance,
        torch=torch.__version__, comfy_kitchen=_version("comfy-kitchen"), python=platform.python_version(),
        threads=torch.get_num_threads(), rows=rows, skipped=skipped, slower=slower, no_slower_for_every_format=ok), indent=1))
    print(f"wrote {out}")
    print(f"cquant is no slower than kitchen for every format (ratio >= {floor:.2f}): "
          + ("YES" if ok else ("NO: " + ", ".join(slower) if rows else "NO: no format registered")))
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
