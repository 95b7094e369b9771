"""Issue 35's targets for baked LoRAs, measured (not timed in tests).

    python bench/bench_lora.py quality [--rank 32] [--rel 0.03] [--modes int4_mixed,int8,fp8,nvfp4,w4a8]
    python bench/bench_lora.py cost [--depth 1]

`quality`: for the DiT (`dit_workload`) and MiniLM (real weights, when fetched), a synthetic kohya LoRA on every linear
of rank `--rank` whose delta is `--rel` of each weight's Frobenius norm; the float merge (`merge_loras` into the float
file) is the reference. Per policy mode, the held-out output SQNR against it of: the unpatched quantized base; the bake
(`merge_loras` into the quantized base); the by-hand route (dequantize the base, add the delta in fp32, quantize the
float result with the same policy); the bake from the reference (`merge_loras(q, reference=float, from_reference=True)`:
each patched module quantized from the float original's merge in the quantized file's formats and options); and the
direct route (`merge_loras(float, policy=)`, which equals quantizing the float merge). Every file is made through the public functions and evaluated through `cq.evaluate`.

`cost`: the FLUX-shaped DiT of `cq.flux_model` at FLUX's widths, quantized `int4_mixed`; a rank-32 LoRA on every linear.
Wall time and peak RSS, each in a fresh process: `quantize_checkpoint` of the float file, `merge_loras` into the
quantized file, `merge_loras(float, policy=)`. Peak: the kernel's peak RSS (VmHWM, restarted just before the job),
less the RSS before the job, over the largest tensor of the checkpoint (target: <= 3x), time against `quantize_checkpoint` (target: <= 1.5x).
"""
import argparse, atexit, dataclasses, json, os, resource, shutil, subprocess, sys, tempfile, time
import torch
import cquant as cq
from cquant.lora import read_lora, merge_patch

def lora_for(sd:dict, rank:int, rel:float, seed:int=0) -> dict:
    "A kohya LoRA on every 2-D weight of `sd` (alpha = rank), its delta `rel` of the weight's Frobenius norm."
    g, out = torch.Generator().manual_seed(seed), {}
    for k, w in sd.items():
        if not k.endswith('.weight') or w.dim() != 2 or not w.is_floating_point() or min(w.shape) < rank: continue
        u, d = torch.randn(w.shape[0], rank, generator=g), torch.randn(rank, w.shape[1], generator=g)
        s = (rel * w.float().norm() / (u @ d).norm()).sqrt()
        n = 'lora_unet_' + k[:-len('.weight')].replace('.', '_')
        out.update({n + '.lora_up.weight': u * s, n + '.lora_down.weight': d * s, n + '.alpha': torch.tensor(float(rank))})
    return out

def by_hand(base:str, lora:dict, dst:str):
    "The by-hand route's float file: the base dequantized (smoothing folded in), the LoRA added in fp32 (kept fp32)."
    patches, out = read_lora(lora), {}
    with cq.open_checkpoint(base) as ck:
        mods = ck.modules()
        for m, keys in ck.groups().items():
            e = mods.get(m)
            for s, k in keys.items():
                if e is not None and e.quantized and s != 'weight' and s in e.spec.weight_keys + ('comfy_quant', 'input_scale', 'pre_quant_scale'): continue
                if s != 'weight': out[k] = ck[k]; continue
                w = ck.quantized(m, e.shape).dequantize(torch.float32) if e is not None and e.quantized else ck[k].float()
                if 'pre_quant_scale' in keys: w = w * ck[keys['pre_quant_scale']].float()
                p = patches.get('lora_unet_' + m.replace('.', '_'))
                w = merge_patch(w, p) if p is not None else w
                out[k] = w if e is not None and e.quantized else w.to(ck[k].dtype)      # the merge stays fp32 until quantized
    cq.save_file(out, dst)

def quality(args):
    loads = [('dit', cq.dit_workload(n=2, tokens=256))]
    try: loads.append(('minilm', cq.minilm_workload()))
    except Exception as e: print(f'minilm skipped: {e}')
    for name, wl in loads:
        d = tempfile.mkdtemp(); atexit.register(shutil.rmtree, d, True)
        sd = {k: v for k, v in wl.model().state_dict().items() if 'comfy_attention' not in k}
        cq.save_file(sd, f'{d}/float.safetensors')
        lora = lora_for(sd, args.rank, args.rel)
        cq.save_file(lora, f'{d}/lora.safetensors')
        cq.merge_loras(f'{d}/float.safetensors', [f'{d}/lora.safetensors'], f'{d}/merged_float.safetensors')
        merged = cq.load_file(f'{d}/merged_float.safetensors')
        ref = dataclasses.replace(wl, model=lambda: cq.load_quantized_model(wl.model(), merged, strict=False))
        print(f'\n{name}: rank {args.rank}, delta {args.rel:.0%} of each weight; output SQNR (dB) against the float merge, held out')
        print(f"{'mode':16} {'base':>7} {'bake':>7} {'by hand':>8} {'from ref':>8} {'direct':>7}  bake - direct  from ref - direct")
        for mode in args.modes.split(','):
            pol = cq.Policy(mode=mode)
            cq.quantize_checkpoint(f'{d}/float.safetensors', f'{d}/q.safetensors', pol, progress=False)
            cq.merge_loras(f'{d}/q.safetensors', [f'{d}/lora.safetensors'], f'{d}/bake.safetensors')
            by_hand(f'{d}/q.safetensors', lora, f'{d}/hand_float.safetensors')
            cq.quantize_checkpoint(f'{d}/hand_float.safetensors', f'{d}/hand.safetensors', pol, progress=False)
            cq.merge_loras(f'{d}/q.safetensors', [f'{d}/lora.safetensors'], f'{d}/fromref.safetensors',
                           reference=f'{d}/float.safetensors', from_reference=True)
            cq.merge_loras(f'{d}/float.safetensors', [f'{d}/lora.safetensors'], f'{d}/direct.safetensors', policy=pol)
            r = {k: cq.evaluate(ref, f'{d}/{k}.safetensors')['sqnr_db'] for k in ('q', 'bake', 'hand', 'fromref', 'direct')}
            print(f"{mode:16} {r['q']:7.2f} {r['bake']:7.2f} {r['hand']:8.2f} {r['fromref']:8.2f} {r['direct']:7.2f}  "
                  f"{r['bake'] - r['direct']:+13.2f}  {r['fromref'] - r['direct']:+16.2f}")

JOBS = {'quantize': "cq.quantize_checkpoint(f'{d}/float.safetensors', f'{d}/out.safetensors', cq.Policy(mode='int4_mixed'), progress=False)",
        'requantize': "cq.quantize_checkpoint(f'{d}/q.safetensors', f'{d}/out.safetensors', cq.Policy(mode='int4_mixed'), progress=False, requantize=True)",
        'bake': "cq.merge_loras(f'{d}/q.safetensors', [f'{d}/lora.safetensors'], f'{d}/out.safetensors')",
        'direct': "cq.merge_loras(f'{d}/float.safetensors', [f'{d}/lora.safetensors'], f'{d}/out.safetensors', policy=cq.Policy(mode='int4_mixed'))"}

PEAK = """
import os, time, json, torch, cquant as cq
page = os.sysconf('SC_PAGE_SIZE')
rss = lambda: int(open('/proc/self/statm').read().split()[1]) * page
hwm = lambda: next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) * 1024
r0 = rss(); open('/proc/self/clear_refs', 'w').write('5')      # the peak RSS (VmHWM) restarts from here
"""

def run_job(job:str, d:str) -> tuple:
    "(seconds, peak RSS bytes, RSS before the job) of one job in a fresh process (the kernel's VmHWM: nothing missed)."
    code = (PEAK + f"d = {d!r}; t = time.perf_counter()\n{JOBS[job]}\nt = time.perf_counter() - t\n"
            "print(json.dumps([t, hwm(), r0]))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))

def cost(args):
    with tempfile.TemporaryDirectory() as d: _cost(args, d)

def _cost(args, d:str):
    sd = cq.flux_model(depth=args.depth, single_depth=args.depth).state_dict()
    cq.save_file(sd, f'{d}/float.safetensors')
    cq.save_file(lora_for(sd, 32, 0.03), f'{d}/lora.safetensors')
    cq.quantize_checkpoint(f'{d}/float.safetensors', f'{d}/q.safetensors', cq.Policy(mode='int4_mixed'), progress=False)
    largest = max(t.numel() * t.element_size() for t in sd.values())
    print(f'FLUX-shaped DiT, depth {args.depth}+{args.depth}: {sum(t.numel() * t.element_size() for t in sd.values()) / 2**20:.0f} MiB bf16, '
          f'largest tensor {largest / 2**20:.0f} MiB')
    base = None
    for job in JOBS:
        t, peak, imports = run_job(job, d)
        base = base or t
        print(f'{job:9} {t:6.2f} s ({t / base:.2f}x quantize)  peak over the RSS before {(peak - imports) / 2**20:6.0f} MiB = '
              f'{(peak - imports) / largest:.2f}x the largest tensor')

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)
    q = sub.add_parser('quality'); q.add_argument('--rank', type=int, default=32); q.add_argument('--rel', type=float, default=0.03)
    q.add_argument('--modes', default='int4_mixed,int8,fp8,nvfp4,w4a8')
    c = sub.add_parser('cost'); c.add_argument('--depth', type=int, default=1)
    args = p.parse_args()
    {'quality': quality, 'cost': cost}[args.cmd](args)
