#!/usr/bin/env python
"""GPU check and benchmark of cquant's Triton INT8 kernels (cquant.kernels.int8) against eager and torch.

Usage: python kernels/harness.py [--quick] [--out kernels/out/int8.json]

On a CUDA machine, for M in {1, 16, 256, 4096} and N = K in {3072, 12288}:
- correctness vs the eager reference (cquant.int8): quantize/dequantize and the int32 GEMM bit-exact,
  the full W8A8 linear bit-exact (max abs/ulp difference reported when not);
- timing (CUDA events via triton.testing.do_bench, median) of each kernel vs torch: quantize/dequantize
  in GB/s, the GEMM in TFLOP/s vs torch._int_mm (eager int_mm path) and bf16 F.linear, with ratios;
- results as JSON (one record per kernel x shape x dtype, with GPU and versions).
Without CUDA it says it needs a GPU and exits 0 (the CPU tests run the kernels in Triton's interpreter).
"""
import argparse, json, os, platform, sys, time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--quick', action='store_true', help='only M in {1, 256} and N=K=3072')
    ap.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'out', 'int8.json'))
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print('kernels/harness.py needs a CUDA GPU; none found, nothing to do '
              '(the CPU tests run these kernels under TRITON_INTERPRET=1).')
        return 0
    import triton
    import torch.nn.functional as F
    from triton.testing import do_bench
    import cquant.int8 as E
    import cquant.kernels.int8 as K

    dev, name = 'cuda', torch.cuda.get_device_name()
    Ms = [1, 256] if args.quick else [1, 16, 256, 4096]
    NKs = [3072] if args.quick else [3072, 12288]
    recs = []

    def rec(**kw):
        kw.update(gpu=name, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
        recs.append(kw)
        print(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in kw.items()
                       if k not in ('gpu', 'torch', 'triton', 'cuda')), flush=True)

    _INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    def same(a, b):
        "Same dtype, shape and bits."
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_INT[a.element_size()]), b.view(_INT[b.element_size()]))

    g = torch.Generator(device=dev).manual_seed(0)
    for NK in NKs:
        w16 = torch.randn(NK, NK, device=dev, generator=g, dtype=torch.bfloat16)
        wq, wsc = E.quantize_rows_int8(w16)
        bias = torch.randn(NK, device=dev, generator=g, dtype=torch.bfloat16)
        for M in Ms:
            x = torch.randn(M, NK, device=dev, generator=g, dtype=torch.bfloat16)
            # quantize
            q, s = K.quantize_rows_int8(x); qe, se = E.quantize_rows_int8(x)
            t_k = do_bench(lambda: K.quantize_rows_int8(x)); t_e = do_bench(lambda: E.quantize_rows_int8(x))
            nbytes = x.numel() * 3 + M * 4
            rec(kernel='quantize_rows_int8', M=M, K=NK, dtype='bf16', exact=bool(same(q, qe) and same(s, se)),
                ms=t_k, eager_ms=t_e, GBps=nbytes / t_k / 1e6, speedup_vs_eager=t_e / t_k)
            # dequantize
            o = K.dequantize_int8(q, s, torch.bfloat16); oe = E.dequantize_int8(q, s, torch.bfloat16)
            t_k = do_bench(lambda: K.dequantize_int8(q, s, torch.bfloat16)); t_e = do_bench(lambda: E.dequantize_int8(q, s, torch.bfloat16))
            rec(kernel='dequantize_int8', M=M, K=NK, dtype='bf16', exact=bool(same(o, oe)), ms=t_k, eager_ms=t_e,
                GBps=nbytes / t_k / 1e6, speedup_vs_eager=t_e / t_k)
            # int32 GEMM
            flops = 2 * M * NK * NK
            acc = K.int8_mm(q, wq); acce = E.int_mm(q, wq.t())
            t_k = do_bench(lambda: K.int8_mm(q, wq)); t_t = do_bench(lambda: E.int_mm(q, wq.t()))
            rec(kernel='int8_mm', M=M, N=NK, K=NK, exact=bool(torch.equal(acc, acce)), ms=t_k, int_mm_ms=t_t,
                TFLOPs=flops / t_k / 1e9, ratio_vs_int_mm=t_t / t_k)
            # full linear
            y = K.int8_linear(x, wq, wsc, bias); ye = E.int8_linear(x, wq, wsc, bias)
            diff = (y.float() - ye.float()).abs().max().item()
            t_k = do_bench(lambda: K.int8_linear(x, wq, wsc, bias)); t_e = do_bench(lambda: E.int8_linear(x, wq, wsc, bias))
            t_b = do_bench(lambda: F.linear(x, w16, bias))
            rec(kernel='int8_linear', M=M, N=NK, K=NK, dtype='bf16', exact=bool(same(y, ye)), max_abs_diff=diff,
                ms=t_k, eager_ms=t_e, bf16_linear_ms=t_b, TFLOPs=flops / t_k / 1e9,
                speedup_vs_eager=t_e / t_k, speedup_vs_bf16=t_b / t_k)
        del w16, wq
        torch.cuda.empty_cache()

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({'host': platform.node(), 'time': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'records': recs}, f, indent=1)
    bad = [r for r in recs if not r['exact']]
    print(f'wrote {args.out}: {len(recs)} records, {len(bad)} not bit-exact')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
