# A/B of quantize_checkpoint's SQNR cost: python bench/ab_sqnr.py CODE_DIR [CODE_DIR ...] (the source: bench_checkpoint.make_source('/tmp/pipe2/src300.safetensors', 0.3, 3072))
import subprocess, sys, json
src = sys.argv[1] if sys.argv[1].endswith('.safetensors') else '/tmp/pipe2/src300.safetensors'
if sys.argv[1].endswith('.safetensors'): sys.argv.pop(1)
child = r'''
import sys, time, json; sys.path.insert(0, sys.argv[1])
import torch
from cquant.jobs import quantize_checkpoint
from cquant.policy import Policy
p = Policy('int4_mixed', preset='none'); r = {}
for m in (False, True, False, True):
    t = time.perf_counter(); rep = quantize_checkpoint(sys.argv[2], sys.argv[2] + '.ab_out.safetensors', p, progress=False, measure=m)
    r.setdefault(str(m), []).append(time.perf_counter() - t)
    if m: r['sqnr_db'] = rep.totals['sqnr_db']
print(json.dumps(r))
'''
for code in sys.argv[1:]:
    out = subprocess.run([sys.executable, '-c', child, code, src], capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    off, on = min(r['False']), min(r['True'])
    print(f"{code}: SQNR off {off:.2f} s ({0.3399/off*1e3:.0f} MB/s), on {on:.2f} s ({0.3399/on*1e3:.0f} MB/s), SQNR costs +{(on/off-1)*100:.0f}%, aggregate {r['sqnr_db']:.6f} dB")
