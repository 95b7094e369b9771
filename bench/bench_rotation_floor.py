"""The rotation GEMM floor of the ConvRot formats: how long the Hadamard rotation alone takes, next to the whole
quantize / dequantize of cquant and of comfy-kitchen eager, on one 4096x4096 bf16 weight (8 outlier columns x12).

    OMP_NUM_THREADS=1 python bench/bench_rotation_floor.py [--repeats 7]

The rotation is the GEMM kitchen runs (`[N K/g, g] @ H.T`, bf16 for a bf16 weight being quantized, fp32 for the
rotation back), here in blocks of 4096 GEMM rows with a reused output, as cquant runs it. Every bit-exact ConvRot
quantize has to run the bf16 one and every dequantize the fp32 one (only the same GEMM reproduces kitchen's sums), so
kitchen_time / gemm_time bounds the ratio kitchen / cquant that any exact implementation can reach.
Times are process time (CPU seconds of this process), median of `--repeats`, all in one process.
"""
from __future__ import annotations
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing cquant

ROWS = [("int8 ConvRot 256", "int8_tensorwise", dict(convrot=True, convrot_groupsize=256),
         "TensorWiseINT8Layout", dict(per_channel=True, convrot=True, convrot_groupsize=256)),
        ("convrot_w4a4", "convrot_w4a4", {}, "TensorCoreConvRotW4A4Layout", {})]


def median_ms(fn, repeats: int) -> float:
    "Median process time of `fn()` in ms, after one warm-up call."
    fn(); ts = []
    for _ in range(repeats):
        t = time.process_time(); fn(); ts.append(time.process_time() - t)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    import cquant as cq
    from cquant.numerics import hadamard
    from comfy_kitchen.tensor import QuantizedTensor as KQT
    torch.manual_seed(0)
    w = torch.randn(4096, 4096)
    w[:, torch.randperm(4096)[:8]] *= 12
    w = w.bfloat16()
    xb, xf = w.reshape(-1, 256), w.float().reshape(-1, 256)
    ob, of = torch.empty_like(xb), torch.empty_like(xf)
    Hb, Hf = hadamard(256, torch.bfloat16).T, hadamard(256).T

    def gemm(x, H, o):
        for i in range(0, x.shape[0], 4096): torch.mm(x[i:i + 4096], H, out=o[i:i + 4096])

    gb, gf = median_ms(lambda: gemm(xb, Hb, ob), args.repeats), median_ms(lambda: gemm(xf, Hf, of), args.repeats)
    print(f"4096x4096 bf16, g=256, torch threads {torch.get_num_threads()}, median of {args.repeats}, process time")
    print(f"rotation GEMM alone: bf16 (quantize) {gb:.1f} ms, fp32 (dequantize) {gf:.1f} ms")
    for name, fmt, opts, k_layout, k_kw in ROWS:
        qt, kt = cq.quantize(w, fmt, **opts), KQT.from_float(w, k_layout, **k_kw)
        cq_q = median_ms(lambda: cq.quantize(w, fmt, **opts), args.repeats)
        ck_q = median_ms(lambda: KQT.from_float(w, k_layout, **k_kw), args.repeats)
        cq_d, ck_d = median_ms(qt.dequantize, args.repeats), median_ms(kt.dequantize, args.repeats)
        print(f"{name}: quantize cquant {cq_q:.1f} / kitchen {ck_q:.1f} ms = {ck_q / cq_q:.2f}x "
              f"(bound kitchen/GEMM {ck_q / gb:.2f}x); dequantize cquant {cq_d:.1f} / kitchen {ck_d:.1f} ms = "
              f"{ck_d / cq_d:.2f}x (bound {ck_d / gf:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
