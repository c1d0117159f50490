#!/usr/bin/env bash
# Issue 56's targets on one H100, in one call (about 6-9 minutes): at Qwen2.5-0.5B shapes (vocabulary
# 151,936, seq 1024, micro-batch 4 x 2, bf16, fused AdamW) the compiled plain loop, the plain loop with
# cut-cross-entropy on the compiled body (its default and exact), the recipes' Trainer at tp=1 and
# torch's own linear_cross_entropy (skipped before torch 2.13), two interleaved rounds of 20 timed
# steps (the second in reverse order); then the head and loss alone on [4096 x 896] hidden states and a
# [151936 x 896] head: ours, cut-cross-entropy, liger-kernel, torch's own and the unfused loss.
#
#   bash scripts/loss_targets_h100.sh                # on the device, with .whl carried (see below)
#   DRY_T="--device cpu --preset nano --vocab 384 --seq-len 32 --micro-batch-size 2 --warmup 1 --steps 1" \
#   DRY_F="--device cpu --tokens 64 --hidden 32 --vocab 512 --warmup 1 --steps 1" OUT=/tmp/out \
#     bash scripts/loss_targets_h100.sh              # the same on the CPU, tiny shapes (a dry run)
#
# The GPU image has no cut-cross-entropy or liger-kernel and no network: their wheels (py3-none-any;
# both need only torch and triton, which the image has) travel in .whl/ (ignored by git):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     cut-cross-entropy==25.1.1 liger-kernel==0.8.5
# Output: the log and the throughput rows' JSON under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
set -o pipefail
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch,transformers,accelerate,triton,cut_cross_entropy as c,liger_kernel; print(torch.__version__,transformers.__version__,accelerate.__version__,triton.__version__,c.__version__)'
  python3 -m pytest -q -p no:cacheprovider tests/test_throughput.py -k host_syncs  # the sync counter on this GPU
  timeout 400 python3 -m taco_accel.bench.throughput --preset 0.5b --vocab 151936 --seq-len 1024 --micro-batch-size 4 \
    --micro-batches 2 --rows plain_compiled,cce_compiled,cce_exact_compiled,taco_tp1,torch_lce_compiled --rounds 2 \
    --warmup 3 --steps 20 --json "$OUT/throughput.json" $DRY_T
  timeout 140 python3 -m taco_accel.bench.fused_loss --tokens 4096 --hidden 896 --vocab 151936 --warmup 2 --steps 10 $DRY_F
} 2>&1 | tee "$OUT/log"
