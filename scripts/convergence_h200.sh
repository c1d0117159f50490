#!/usr/bin/env bash
# The ~100M-parameter convergence study (taco_accel.bench.convergence --preset h200-100m) on one GPU,
# inside one time limit: tokenise once, then every run of one seed as its own process, all at once
# (under MPS when the machine has it: tiny kernels of several processes then share the GPU), each
# cut by --time-budget at a validation; optionally the same-weights fidelity of other codecs.
#
#   SEED=0 VARIANTS="none reorder taco" bash scripts/convergence_h200.sh
#   SEED=1 VARIANTS="none taco" FIDELITY="naive no-hadamard int8 taco taco-dual e5m2" bash scripts/convergence_h200.sh
#
# Environment: SEED, VARIANTS, FIDELITY (codecs measured at the weights of a seed-0 uncompressed
# run; empty: none), STEPS (1500), EVAL (validation interval, 125), TOTAL (seconds for everything,
# 540), RESULTS (where the records, logs and tables are copied; default $OUT or runs/h200_results).
# Data: the Python standard library and torch's own sources (~10M training tokens).
set -u
export TRITON_DEFAULT_FP_FUSION=1
SEED=${SEED:-0}; VARIANTS=${VARIANTS:-none reorder taco}; FIDELITY=${FIDELITY:-}
STEPS=${STEPS:-1500}; EVAL=${EVAL:-125}; TOTAL=${TOTAL:-540}; PRESET=${PRESET:-h200-100m}
RESULTS=${RESULTS:-${OUT:-runs/h200_results}}
WORK=${WORK:-/tmp/convergence_h200}  # records and the token cache (large: not copied)
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
TORCH=$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')
DATA=("$STDLIB/*.py" "$STDLIB/*/*.py" "$STDLIB/*/*/*.py" "$TORCH/*/*.py" "$TORCH/*/*/*.py")
COMMON=(--preset "$PRESET" --steps "$STEPS" --eval-every "$EVAL" --data "${DATA[@]}" --out "$WORK")
t0=$(date +%s)
mkdir -p "$RESULTS"
python -m taco_accel.bench.convergence "${COMMON[@]}" --prepare 2>&1 | grep -v Warn | tail -1
MPS=0
if command -v nvidia-cuda-mps-control >/dev/null && [ "${NO_MPS:-0}" = 0 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog
  nvidia-cuda-mps-control -d && timeout 60 python -c "import torch; torch.ones(4, device='cuda').sum().item()" && MPS=1
  if [ $MPS = 0 ]; then echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
fi
left=$(( TOTAL - ($(date +%s) - t0) ))
BUDGET=$(python -c "print(round(max(30, $left - 50) / 60, 2))")  # a run may overrun to its next validation
echo "MPS=$MPS; data ready after $(( $(date +%s) - t0 )) s; runs: $VARIANTS (seed $SEED), budget $BUDGET min"
for v in $VARIANTS; do
  timeout $(( left - 10 )) python -m taco_accel.bench.convergence "${COMMON[@]}" --variants "$v" --seeds "$SEED" \
    --time-budget "$BUDGET" > "$RESULTS/h200_${v}_$SEED.log" 2>&1 &
done
if [ -n "$FIDELITY" ]; then
  timeout $(( left - 10 )) python -m taco_accel.bench.convergence "${COMMON[@]}" --seeds 0 --variants none $FIDELITY \
    --fidelity-only > "$RESULTS/h200_fidelity.log" 2>&1 &
fi
wait
[ $MPS = 1 ] && echo quit | nvidia-cuda-mps-control
for seed in $SEED 0; do
  [ -d "$WORK/seed$seed" ] && mkdir -p "$RESULTS/seed$seed" && cp "$WORK/seed$seed"/*.json "$RESULTS/seed$seed/"
done
python -m taco_accel.bench.convergence "${COMMON[@]}" --variants $VARIANTS --seeds "$SEED" --report 2>&1 \
  | grep -v Warn | tee "$RESULTS/report_$SEED.txt"
if [ -n "$FIDELITY" ]; then
  python -m taco_accel.bench.convergence "${COMMON[@]}" --variants none $FIDELITY --seeds 0 --report 2>&1 \
    | grep -v Warn | sed -n '/same weights\|weights (seed/,$p' | tee "$RESULTS/fidelity.txt"
fi
