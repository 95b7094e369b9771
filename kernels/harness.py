#!/usr/bin/env python
"""GPU check and benchmark of every cquant Triton kernel against the eager layouts, torch and comfy-kitchen.

Usage: python kernels/harness.py [--quick] [--out kernels/out/harness.json]
       TRITON_INTERPRET=1 python kernels/harness.py --smoke      # CPU: tiny shapes through the interpreter

On a CUDA machine, for every format the kernels cover and N = K in {3072, 12288}:
- quantize and dequantize through the registered fast path vs the eager layout: bit-exact or not, time,
  achieved GB/s and the fraction of HBM peak, speed-up vs eager and vs comfy-kitchen's CUDA backend;
- the quantized linear for M in {1, 16, 256, 4096}: exact or max relative difference vs eager, TFLOP/s and the
  fraction of the tensor-core peak (int8 / fp8 / bf16), ratio vs bf16 F.linear, torch._int_mm (integer formats),
  torch._scaled_mm (FP8) and kitchen's linear where it has one;
- SOL attention (bf16, H=8, D=128, T in {4096, 16384}): the kernel's error over its stated bound vs
  cq.sol_attention, time vs the reference, SDPA and kitchen's sol_attn.
- the INT8 attention kernel (case `int8_attention`, B = 1, H = 8, D = 128, T in {1024, 4096, 8192}): max fp32
  difference to the torch reference, time (and the quantize step's), TFLOP/s, ratio vs bf16 SDPA and kitchen's.
Timings are CUDA-event medians (triton.testing.do_bench). Results go to JSON, one record per kernel x shape.
Without CUDA (and without --smoke) it says it needs a GPU and exits 0.
"""
import argparse, json, os, platform, sys, time

CASES = [  # (label, format, options)
    ('fp8_e4m3', 'float8_e4m3fn', {}), ('fp8_e5m2', 'float8_e5m2', {}), ('nvfp4', 'nvfp4', {}), ('mxfp8', 'mxfp8', {}),
    ('int8_row', 'int8_tensorwise', {'per_row': True}), ('int8_convrot', 'int8_tensorwise', {'convrot': True}),
    ('w4a4', 'convrot_w4a4', {}), ('w4a4_a8', 'convrot_w4a4', {'linear_dtype': 'int8'}),
    ('w4a8', 'asym_w4a8_int8', {}), ('w6a8', 'w6a8_int8', {}),
    ('awq_w4a16', 'awq_w4a16', {}), ('svdquant_w4a4', 'svdquant_w4a4', {}),
    ('svdquant_tiled', 'svdquant_w4a4', {'layout': 'kitchen_tile_packed_w4a4'}),
]
PEAKS = {  # dense peaks per GPU: HBM bytes/s, bf16 / fp8 / int8 tensor-core FLOP/s (vendor data sheets, SXM)
    'H200': dict(hbm=4.8e12, bf16=989e12, fp8=1979e12, int8=1979e12),
    'H100': dict(hbm=3.35e12, bf16=989e12, fp8=1979e12, int8=1979e12),
    'A100': dict(hbm=2.0e12, bf16=312e12, fp8=None, int8=624e12),
}
ENGINE = {'float8_e4m3fn': 'fp8', 'float8_e5m2': 'fp8', 'nvfp4': 'fp8', 'mxfp8': 'fp8',
          'awq_w4a16': 'bf16'}   # else int8 (svdquant_w4a4: its int4 group sums run as int8 tl.dot)


def _peaks(name):
    return next((v for k, v in PEAKS.items() if k in name), {})


def attention_records(args, dev, g, bench, peer, rec, peaks, ck):
    "The INT8 attention kernel vs its torch reference (fp32 difference), torch SDPA and kitchen's CUDA int8_attention."
    import torch
    import torch.nn.functional as F
    from dataclasses import replace
    from cquant.int8_attention import prequantize_int8_attention, int8_attention_from_prequantized
    from cquant.kernels.int8_attention import int8_attention_kernel
    H, D = (2, 64) if args.smoke else (8, 128)
    for T in [96] if args.smoke else [1024, 4096] if args.quick else [1024, 4096, 8192]:
        q, k, v = (torch.randn(1, H, T, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
        pq = prequantize_int8_attention(q, k, v)
        out = int8_attention_kernel(pq, fp32_out=True)
        ref = int8_attention_from_prequantized(replace(pq, input_dtype=torch.float64))
        t_k = bench(lambda: int8_attention_kernel(pq))
        t_q = bench(lambda: prequantize_int8_attention(q, k, v))
        t_sdpa = peer(lambda: F.scaled_dot_product_attention(q, k, v))
        t_ck = peer(lambda: ck.int8_attention(q, k, v)) if ck is not None and dev == 'cuda' else None
        flops, pk = 4 * H * T * T * D, peaks.get('int8') if peaks else None
        rec(kernel='attention', case='int8_attention', B=1, H=H, T=T, D=D, exact=False,
            max_diff=(out.double() - ref).abs().max().item(), ms=t_k, quantize_ms=t_q, TFLOPs=flops / t_k / 1e9,
            peak_frac=(flops / t_k / 1e-3 / pk) if pk else None, vs_sdpa=(t_sdpa / t_k) if t_sdpa else None,
            vs_kitchen=(t_ck / t_k) if t_ck else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--quick', action='store_true', help='only M in {1, 256} and N=K=3072')
    ap.add_argument('--smoke', action='store_true', help='tiny shapes, no peers: checks the harness itself (CPU interpreter)')
    ap.add_argument('--formats', default=None, help='comma-separated case labels (default: all)')
    ap.add_argument('--budget', type=float, default=None, help='seconds: start no case after this (they are recorded as skipped)')
    ap.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'out', 'harness.json'))
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available() and not args.smoke:
        print('kernels/harness.py needs a CUDA GPU; none found, nothing to do '
              '(the CPU tests run these kernels under TRITON_INTERPRET=1; --smoke runs this script there).')
        return 0
    import triton
    import torch.nn.functional as F
    import cquant as cq
    from cquant.kernels import dispatch
    from cquant.tensor import FORMATS, FAST_PATHS, same_bits

    cuda = torch.cuda.is_available()
    dev = 'cuda' if cuda else 'cpu'
    name = torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'
    peaks = _peaks(name)
    Ms = [1, 4] if args.smoke else [1, 256] if args.quick else [1, 16, 256, 4096]
    NKs = [256] if args.smoke else [3072] if args.quick else [3072, 12288]
    cases = [c for c in CASES if args.formats is None or c[0] in args.formats.split(',')]
    try:
        import comfy_kitchen as ck
    except Exception:
        ck = None

    def bench(fn):
        if args.smoke:
            t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=50)

    recs, t_start = [], time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    def save():
        "Write every record so far (after each one: a run cut short keeps what it measured)."
        with open(args.out, 'w') as f:
            json.dump(dict(records=recs, peer_errors=peer_errors, seconds=time.time() - t_start, host=platform.node(),
                           argv=sys.argv[1:]), f, indent=1)

    def rec(**kw):
        kw.update(gpu=name, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
        recs.append(kw); save()
        print(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in kw.items()
                       if k not in ('gpu', 'torch', 'triton', 'cuda')), flush=True)

    peer_errors = []
    def peer(fn):
        "Time a peer (--smoke: only run it once), or None (with the reason printed) when it cannot run here."
        try: fn()
        except Exception as e:
            peer_errors.append(f'{type(e).__name__}: {str(e)[:120]}')
            print(f'    peer unavailable: {peer_errors[-1]}'); return None
        return None if args.smoke else bench(fn)

    def nbytes(*ts): return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    kernel_ops = {(layout, op) for layout, op, *_ in dispatch.kernel_paths()}
    def covered(layout, op): return (layout, op) in kernel_ops

    def fits(layout, op, *a, **k):
        "Whether a registered kernel takes this call (else the eager path would run on both sides)."
        ok = any(f(*a, **k) for f, _ in FAST_PATHS.get((layout, op), ()))
        if not ok: print(f'    {layout.__name__}.{op}: no kernel fits this call, skipped')
        return ok

    def tensors_equal(a, b):
        ta, tb = a.state_dict(''), b.state_dict('')
        return ta.keys() == tb.keys() and all(same_bits(ta[k].cpu(), tb[k].cpu()) for k in ta)

    def cpu_bits(ref_cpu, **got):
        "On a GPU: whether each result has the bits of the CPU's eager path (the bits a file quantized there holds)."
        if ref_cpu is None: return {}
        eq = lambda a, b: same_bits(a.cpu(), b) if isinstance(a, torch.Tensor) else tensors_equal(a, b)
        return {f'{k}_as_cpu': eq(v, ref_cpu) for k, v in got.items()}

    def kitchen_quantize(fmt, w):
        if ck is None: return None
        f = {'float8_e4m3fn': lambda: ck.quantize_per_tensor_fp8(w, (w.abs().amax().float() / 448)),
             'nvfp4': lambda: ck.quantize_nvfp4(w, w.abs().amax().float() / (448 * 6), pad_16x=True),
             'mxfp8': lambda: ck.quantize_mxfp8(w, pad_32x=True),
             'int8_tensorwise': lambda: ck.quantize_int8_rowwise(w),
             'convrot_w4a4': lambda: ck.quantize_convrot_w4a4_weight(w)}.get(fmt)
        return f

    def kitchen_linear(fmt, qt, x, b):
        if ck is None: return None
        p, q = qt.params, qt.qdata
        f = {'int8_tensorwise': lambda: ck.int8_linear(x, q, p.scale, b, convrot=p.convrot, convrot_groupsize=p.convrot_groupsize),
             'convrot_w4a4': lambda: ck.convrot_w4a4_linear(x, q, p.scale, b, convrot_groupsize=p.convrot_groupsize,
                                                            linear_dtype=p.linear_dtype),
             'asym_w4a8_int8': lambda: ck.w4a8_int8_linear(x, q, p.s_rel, p.s_channel, p.codebook if torch.is_tensor(p.codebook) else None,
                                                           p.correction, b, p.group_size, p.convrot_groupsize, x.dtype)}.get(fmt)
        return f

    g = torch.Generator(device=dev).manual_seed(0)

    def format_case(label, fmt, opts, NK, w, bias):
        "The quantize, dequantize and linear records of one format case, each op attempted on its own."
        spec = FORMATS[fmt]
        dispatch.disable()
        qe = cq.quantize(w, fmt, **opts)
        t_e = bench(lambda: cq.quantize(w, fmt, **opts)) if covered(spec.layout, 'quantize') else None
        qc = cq.quantize(w.cpu(), fmt, **opts) if cuda or args.smoke else None     # smoke: checks this path
        dispatch.enable(cpu=args.smoke, strict=True)
        attempt(f'{label} quantize N=K={NK}', quantize_op, label, fmt, opts, NK, w, spec, qe, t_e, qc)
        attempt(f'{label} dequantize N=K={NK}', dequantize_op, label, NK, spec, qe, qc)
        if covered(spec.layout, 'linear'):
            for M in Ms: attempt(f'{label} linear M={M} N=K={NK}', linear_op, label, fmt, M, NK, w, bias, spec, qe)

    def quantize_op(label, fmt, opts, NK, w, spec, qe, t_e, qc):
        if covered(spec.layout, 'quantize') and fits(spec.layout, 'quantize', w, stochastic_rounding=0,
                                                     **spec.resolve(None, **opts)):
            qk = cq.quantize(w, fmt, **opts)
            t_k = bench(lambda: cq.quantize(w, fmt, **opts))
            mb = nbytes(w, *qk.state_dict('').values())
            kq = kitchen_quantize(fmt, w)
            t_ck = peer(kq) if kq else None
            rec(kernel='quantize', case=label, N=NK, K=NK, exact=tensors_equal(qk, qe), ms=t_k, eager_ms=t_e,
                GBps=mb / t_k / 1e6, hbm_frac=(mb / t_k / 1e-3 / peaks['hbm']) if peaks else None,
                speedup_vs_eager=t_e / t_k if t_e else None, speedup_vs_kitchen=t_ck / t_k if t_ck else None,
                **cpu_bits(qc, kernel=qk, eager=qe))

    def dequantize_op(label, NK, spec, qe, qc):
        if covered(spec.layout, 'dequantize') and fits(spec.layout, 'dequantize', qe.qdata, qe.params, torch.bfloat16):
            dk = qe.dequantize(torch.bfloat16)
            t_k = bench(lambda: qe.dequantize(torch.bfloat16))
            dispatch.disable()
            de = qe.dequantize(torch.bfloat16); t_e = bench(lambda: qe.dequantize(torch.bfloat16))
            dispatch.enable(cpu=args.smoke, strict=True)
            mb = nbytes(de, *qe.state_dict('').values())
            dc = qc.dequantize(torch.bfloat16) if qc is not None and tensors_equal(qe, qc) else None
            rec(kernel='dequantize', case=label, N=NK, K=NK, exact=same_bits(dk, de), ms=t_k, eager_ms=t_e,
                GBps=mb / t_k / 1e6, hbm_frac=(mb / t_k / 1e-3 / peaks['hbm']) if peaks else None, speedup_vs_eager=t_e / t_k,
                **cpu_bits(dc, kernel=dk, eager=de))

    def linear_op(label, fmt, M, NK, w, bias, spec, qe):
        x = torch.randn(M, NK, device=dev, generator=g, dtype=torch.bfloat16)
        if not fits(spec.layout, 'linear', x, qe.qdata, qe.params, bias, None): return
        yk = qe.linear(x, bias); t_k = bench(lambda: qe.linear(x, bias))
        dispatch.disable()
        ye = qe.linear(x, bias); t_e = bench(lambda: qe.linear(x, bias))
        dispatch.enable(cpu=args.smoke, strict=True)
        flops = 2 * M * NK * NK
        rel = ((yk.float() - ye.float()).norm() / ye.float().norm().clamp_min(1e-30)).item()
        t_bf16 = peer(lambda: F.linear(x, w, bias))
        t_int = peer(lambda: torch._int_mm(torch.ones(max(M, 17), NK, dtype=torch.int8, device=dev), qe.qdata.t())) \
            if spec.storage.dtype == torch.int8 and qe.qdata.shape[1] == NK else None
        t_sc = None
        if spec.storage.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and fmt != 'mxfp8':
            xf = x.to(spec.storage.dtype) if spec.storage.dtype == torch.float8_e4m3fn else x.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            t_sc = peer(lambda: torch._scaled_mm(xf, qe.qdata.t(), one, one, bias=bias, out_dtype=torch.bfloat16))
        kl = kitchen_linear(fmt, qe, x, bias)
        t_ck = peer(kl) if kl else None
        pk = peaks.get(ENGINE.get(fmt, 'int8')) if peaks else None
        rec(kernel='linear', case=label, M=M, N=NK, K=NK, exact=same_bits(yk, ye), rel_diff=rel, ms=t_k, eager_ms=t_e,
            TFLOPs=flops / t_k / 1e9, peak_frac=(flops / t_k / 1e-3 / pk) if pk else None,
            speedup_vs_eager=t_e / t_k, vs_bf16=(t_bf16 / t_k) if t_bf16 else None,
            vs_int_mm=(t_int / t_k) if t_int else None, vs_scaled_mm=(t_sc / t_k) if t_sc else None,
            vs_kitchen=(t_ck / t_k) if t_ck else None)

    def attempt(what, fn, *a):
        "Run one case; a failure (a kernel that does not compile here, say) is recorded and the next case runs."
        if args.budget and time.time() - t_start > args.budget:
            rec(kernel='skipped', case=what, reason=f'over the --budget of {args.budget} s'); return
        try: fn(*a)
        except Exception as e:
            import traceback
            rec(kernel='error', case=what, error=f'{type(e).__name__}: {str(e)[:400]}',
                where=''.join(traceback.format_exc().splitlines(True)[-6:])[-1200:])
        finally: dispatch.enable(cpu=args.smoke, strict=True)

    for NK in NKs:
        w = torch.randn(NK, NK, device=dev, generator=g, dtype=torch.bfloat16)
        bias = torch.randn(NK, device=dev, generator=g, dtype=torch.bfloat16)
        for label, fmt, opts in cases: attempt(f'{label} N=K={NK}', format_case, label, fmt, opts, NK, w, bias)
        del w, bias

    def sol_case(T):
        "SOL attention at length T: within its bound of cq.sol_attention, times against the reference, SDPA and kitchen."
        from cquant.kernels.sol import sol_attention_kernel, sol_kernel_report
        H = 2 if args.smoke else 8
        q, k, v = (torch.randn(1, T, H, 128, device=dev, generator=g).bfloat16() for _ in range(3))
        r = sol_kernel_report(q, k, v, tau=1.0)
        err = r['err'] if r['routing_ok'] else float('inf')
        t_k = bench(lambda: sol_attention_kernel(q, k, v, tau=1.0))
        t_e = bench(lambda: cq.sol_attention(q, k, v, tau=1.0))
        t_sdpa = peer(lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))))
        t_ck = peer(lambda: ck.sol_attn(q, k, v, tau=1.0)) if ck else None
        rec(kernel='sol_attention', case='sol_attention', T=T, H=H, D=128, within_bound=err <= 1, err_over_bound=err,
            route_flips=r['flips'],
            ms=t_k, eager_ms=t_e, speedup_vs_eager=t_e / t_k, vs_sdpa=(t_sdpa / t_k) if t_sdpa else None,
            vs_kitchen=(t_ck / t_k) if t_ck else None)

    if args.formats is None or 'sol_attention' in args.formats.split(','):
        # the SOL attention forward (cquant.kernels.sol) vs the reference cq.sol_attention, SDPA and kitchen's sol_attn
        # (the kernel routes on its own: route_flips counts blocks routed otherwise than the reference, all of them
        # within the stated rounding tolerance when within_bound; the output is checked on the kernel's routing)
        for T in [128] if args.smoke else [4096] if args.quick else [4096, 16384]: attempt(f"sol_attention T={T}", sol_case, T)
    dispatch.disable()
    if args.formats is None or 'int8_attention' in args.formats.split(','):
        attempt('int8_attention', attention_records, args, dev, g, bench, peer, rec, peaks, ck)
    dispatch.disable()
    save()
    bad = [r for r in recs if r['kernel'] in ('quantize', 'dequantize') and not r['exact']]
    bad += [r for r in recs if r['kernel'] == 'sol_attention' and not r['within_bound']]
    errors = [r for r in recs if r['kernel'] in ('error', 'skipped')]
    print(f'{len(recs)} records in {time.time() - t_start:.0f} s -> {args.out}; quantize/dequantize not bit-exact '
          f'or SOL attention out of bound: {len(bad)}; failed or skipped: {len(errors)}')
    return 1 if bad or errors else 0


if __name__ == '__main__':
    sys.exit(main())
