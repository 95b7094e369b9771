#!/usr/bin/env bash
# The whole GPU check of issue 38 in one run on a lent GPU machine (at most 7 minutes), every result under $OUT:
#   1. kernels/harness.py --quick: every format's kernels and both attention kernels, exactness and speed;
#   2. bench/bench_checkpoint.py: quantize_checkpoint(device='cuda') on a 2 GB bf16 checkpoint, against the CPU path
#      (GB/s, SHA-256 of both outputs, peak GPU memory);
#   3. bench/bench_record.py device: the FLUX-shaped block recorded and GPTQ-quantized from its statistics on the GPU.
# `bash kernels/device_run.sh rerun` is the second run (at most 7.5 minutes): the cases the first left out or failed;
# `bash kernels/device_run.sh modes` the third (at most 4 minutes): the GPU job's bytes against the CPU's, per mode.
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
if [ "${1:-}" = modes ]; then    # the third run: the GPU job's bytes against the CPU's, per mode (which formats differ)
  for m in fp8 nvfp4 mxfp8 int8 int8_convrot int4_mixed; do
    step "quantize_checkpoint --mode $m on cuda vs cpu, 1 GB"
    timeout 40 python3 bench/bench_checkpoint.py --gb 1 --mode $m --device cuda --no-peer --compare-cpu --dir /tmp/cq_ckpt \
        --out "$OUT/checkpoint_$m.json" > "$OUT/checkpoint_$m.log" 2>&1
    step "$m rc=$?"
  done
  exit 0
fi
if [ "${1:-}" = rerun ]; then    # the second run: what the first left out (over its budget) or failed, then the job with the kernels
  step "1. harness: attention"
  timeout 130 python3 kernels/harness.py --quick --formats sol_attention,int8_attention --budget 90 \
      --out "$OUT/harness_attention.json" > "$OUT/harness_attention.log" 2>&1
  step "harness attention rc=$?"
  step "2. harness: the rotated formats, w6a8 and the low-bit kernels"
  timeout 190 python3 kernels/harness.py --quick --formats int8_convrot,w4a4,w4a4_a8,w6a8,awq_w4a16,svdquant_w4a4,svdquant_tiled \
      --budget 140 --out "$OUT/harness_rest.json" > "$OUT/harness_rest.log" 2>&1
  step "harness rest rc=$?"
  step "3. quantize_checkpoint on cuda with the Triton kernels vs cpu, 2 GB"
  timeout 100 python3 bench/bench_checkpoint.py --gb 2 --device cuda --kernels --no-peer --compare-cpu --dir /tmp/cq_ckpt \
      --out "$OUT/checkpoint_kernels.json" > "$OUT/checkpoint_kernels.log" 2>&1
  step "checkpoint kernels rc=$?"
  exit 0
fi
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
