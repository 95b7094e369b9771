#!/usr/bin/env bash
# The whole GPU check of issue 38 in one run on a lent GPU machine (at most 7 minutes), every result under $OUT:
#   1. kernels/harness.py --quick: every format's kernels and both attention kernels, exactness and speed;
#   2. bench/bench_checkpoint.py: quantize_checkpoint(device='cuda') on a 2 GB bf16 checkpoint, against the CPU path
#      (GB/s, SHA-256 of both outputs, peak GPU memory);
#   3. bench/bench_record.py device: the FLUX-shaped block recorded and GPTQ-quantized from its statistics on the GPU.
# Each step has its own time limit, so one that fails or hangs leaves the others their time.
# The machine has torch and triton but not fastcore or comfy-kitchen: put them in .dev/ (ignored by git) and carry it:
#   .dev/fastcore-*.whl (pip download fastcore), .dev/ck.tar.gz (comfy-kitchen's cp312 wheel unpacked, without
#   its hip and ascend backends, which are too large to carry). Run from the repository's root.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/cquant_device}; mkdir -p "$OUT" /tmp/site
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/*.whl >> "$OUT/steps.log" 2>&1
[ -f .dev/ck.tar.gz ] && tar xzf .dev/ck.tar.gz -C /tmp/site
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
  python3 -c "import os; print('cpus', os.cpu_count())"
  python3 -c "import comfy_kitchen as ck; print('comfy_kitchen', ck.__file__); print(ck.list_backends() if hasattr(ck, 'list_backends') else '')"
  git log -1 --format='commit %H' 2>/dev/null; } > "$OUT/env.txt" 2>&1
step "1. kernels/harness.py --quick"
timeout 220 python3 kernels/harness.py --quick --budget 170 --out "$OUT/harness.json" > "$OUT/harness.log" 2>&1
step "harness rc=$?"
step "2. quantize_checkpoint on cuda vs cpu, 2 GB"
timeout 110 python3 bench/bench_checkpoint.py --gb 2 --device cuda --no-peer --compare-cpu --dir /tmp/cq_ckpt \
    --out "$OUT/checkpoint.json" > "$OUT/checkpoint.log" 2>&1
step "checkpoint rc=$?"
step "3. FLUX block: record and GPTQ on cuda"
timeout 90 python3 bench/bench_record.py device --device cuda --n 8 > "$OUT/gptq.log" 2>&1
step "gptq rc=$?"
