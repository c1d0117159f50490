#!/usr/bin/env bash
# Set-up: the right torch for this machine, then taco_accel with its test and data extras.
#  - torch already installed (any version >= 2.6): kept as it is;
#  - an NVIDIA GPU: the default (CUDA) wheel from PyPI;
#  - no GPU: torch 2.13.0, taken from the CPU wheel index (or a local wheel where pip has one)
#    instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c 'import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 6) else 1)' 2>/dev/null; then
  echo "install.sh: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -m pip install "torch>=2.6"
else
  cpu_index=${TACO_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$cpu_index" 2>/dev/null; then
    "$PY" -m pip install torch==2.13.0 --index-url "$cpu_index"
  else  # offline mirrors and wheel caches (this CI's machines carry the CPU wheel)
    "$PY" -m pip install torch==2.13.0
  fi
fi
"$PY" -m pip install -e ".[dev]"
