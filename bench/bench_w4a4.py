"""convrot_w4a4: quantize / dequantize (and the int4 linear) speed of cquant vs comfy-kitchen eager.

    python bench/bench_w4a4.py [--shape 4096 4096] [--dtype bf16] [--group 256] [--repeats 5] [--tokens 256]
                               [--tolerance 0.05] [--strict]

One process, one weight (randn, seed 0). Each operation is warmed up once, then the best of `--repeats` runs
(time.perf_counter) is kept, cquant and kitchen interleaved run by run so that load from other processes hits
both alike. The outputs are checked bit for bit against kitchen before timing (a fast wrong answer is no answer).

- quantize:   `cquant.w4a4.quantize_w4a4_weight`  vs `ck.quantize_convrot_w4a4_weight` (eager backend)
- dequantize: `cquant.w4a4.dequantize_w4a4_weight` vs `ck.dequantize_convrot_w4a4_weight`, to the weight's dtype
- linear (informative, `--tokens` M; 0 skips it): `w4a4_linear` int4 (kitchen's eager math), its exact variant
  and the int8-activation variant, vs `ck.convrot_w4a4_linear`

Prints seconds and ratio = kitchen / cquant (> 1: cquant faster) and writes bench/out/w4a4.json. `--strict` exits 1
if cquant is slower (ratio < 1 - tolerance) at quantize or dequantize.
"""
from __future__ import annotations
import argparse, json, platform, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def best_pair(ours, theirs, repeats: int) -> tuple[float, float]:
    "Best wall times of `ours` and `theirs` over `repeats` interleaved runs (after one warm-up each)."
    ours(); theirs()
    b_ours = b_theirs = float("inf")
    for _ in range(repeats):
        t = time.perf_counter(); ours(); b_ours = min(b_ours, time.perf_counter() - t)
        t = time.perf_counter(); theirs(); b_theirs = min(b_theirs, time.perf_counter() - t)
    return b_ours, b_theirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(4096, 4096))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--group", type=int, default=256, help="convrot_groupsize")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256, help="M of the linear timing (0: skip the linear)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="ratio >= 1 - tolerance counts as no slower (timing noise)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "w4a4.json"))
    ap.add_argument("--strict", action="store_true", help="exit 1 if cquant is slower at quantize or dequantize")
    args = ap.parse_args(argv)

    import comfy_kitchen as ck
    from importlib.metadata import version as _version
    from cquant.tensor import test_bits
    from cquant.w4a4 import quantize_w4a4_weight, dequantize_w4a4_weight, w4a4_linear

    dt, G = DTYPES[args.dtype], args.group
    torch.manual_seed(0)
    w = torch.randn(*args.shape, dtype=torch.float32).to(dt)
    rows = []
    with ck.use_backend("eager"):
        q, s = quantize_w4a4_weight(w, G)
        kq, ks = ck.quantize_convrot_w4a4_weight(w, G, 64, 0)
        test_bits(q, kq, "qdata"); test_bits(s, ks, "scale")
        test_bits(dequantize_w4a4_weight(q, s, G, dt), ck.dequantize_convrot_w4a4_weight(kq, ks, G, 64, dt), "dequantize")

        def add(op, ours, theirs):
            a, b = best_pair(ours, theirs, args.repeats)
            rows.append(dict(op=op, cquant_s=a, kitchen_s=b, ratio=b / a))

        add("quantize", lambda: quantize_w4a4_weight(w, G), lambda: ck.quantize_convrot_w4a4_weight(w, G, 64, 0))
        add("dequantize", lambda: dequantize_w4a4_weight(q, s, G, dt), lambda: ck.dequantize_convrot_w4a4_weight(kq, ks, G, 64, dt))
        if args.tokens:
            x = torch.randn(args.tokens, args.shape[1]).to(dt)
            test_bits(w4a4_linear(x, q, s, None, G), ck.convrot_w4a4_linear(x, kq, ks, None, G), "linear")
            k_lin = lambda: ck.convrot_w4a4_linear(x, kq, ks, None, G)
            add(f"linear int4 M={args.tokens}", lambda: w4a4_linear(x, q, s, None, G), k_lin)
            add(f"linear int4 exact M={args.tokens}", lambda: w4a4_linear(x, q, s, None, G, exact=True), k_lin)
            add(f"linear int8 act M={args.tokens}", lambda: w4a4_linear(x, q, s, None, G, "int8"), k_lin)

    floor = 1.0 - args.tolerance
    print(f"convrot_w4a4, {args.shape[0]}x{args.shape[1]} {args.dtype} weight, G={G}, best of {args.repeats}, seconds; "
          f"ratio = kitchen / cquant (> 1: cquant faster); torch threads {torch.get_num_threads()}")
    hdr = f"{'operation':<26} {'cquant':>9} {'kitchen':>9} {'ratio':>7}"
    print(hdr); print("-" * len(hdr))
    for r in rows:
        flag = "  <- cquant slower" if r["ratio"] < floor and not r["op"].startswith("linear") else ""
        print(f"{r['op']:<26} {r['cquant_s']:>9.4f} {r['kitchen_s']:>9.4f} {r['ratio']:>7.2f}{flag}")
    slower = [f"{r['op']} ({r['ratio']:.2f})" for r in rows if r["op"] in ("quantize", "dequantize") and r["ratio"] < floor]
    ok = not slower
    out = Path(args.out); out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        format="convrot_w4a4", shape=list(args.shape), dtype=args.dtype, convrot_groupsize=G, repeats=args.repeats,
        tokens=args.tokens, tolerance=args.tolerance, torch=torch.__version__, comfy_kitchen=_version("comfy-kitchen"),
        python=platform.python_version(), threads=torch.get_num_threads(), rows=rows, slower=slower,
        no_slower=ok), indent=1))
    print(f"wrote {out}")
    print(f"cquant quantize/dequantize no slower than kitchen (ratio >= {floor:.2f}): " + ("YES" if ok else "NO: " + ", ".join(slower)))
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
