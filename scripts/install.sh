#!/usr/bin/env bash
# Set-up: one tested stack of taco_accel's dependencies (scripts/stacks/<stack>.txt pins torch,
# Triton, transformers, Accelerate, peft and TRL), then taco_accel editable with its dev extras.
#
#   bash scripts/install.sh                  the newest stack into this python3 (PYTHON=... for another)
#   bash scripts/install.sh --stack oldest   the oldest stack into the venv .venv-oldest (--venv DIR: another)
#
# torch: the newest stack keeps an installed torch inside pyproject's bound (a GPU box's own CUDA
# build stays); else it installs, on a GPU box, the newest CUDA wheel inside the bound, and without
# a GPU the stack's pin: the CPU wheel from the CPU index where it is reachable
# (TACO_TORCH_CPU_INDEX), else the package index's build (PyPI's: a CUDA build, which runs on CPU).
# The oldest stack installs its pin. Triton is pinned with torch only: a torch kept or installed
# off the pin brings its own.
# The pins are the constraints of every pip call here, through PIP_CONSTRAINT, which takes the place
# of a constraint file in the pip configuration (one that caps torch below the pin would refuse the
# stack); a PIP_CONSTRAINT already set is kept beside them.
set -euo pipefail
cd "$(dirname "$0")/.."

stack=newest
venv=
while [ $# -gt 0 ]; do
  case "$1" in
    --stack) stack=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
    --stack=*) stack=${1#--stack=}; shift ;;
    --venv) venv=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
    --venv=*) venv=${1#--venv=}; shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$1': use --stack newest|oldest and --venv DIR" >&2; exit 2 ;;
  esac
done
pins=scripts/stacks/$stack.txt
if [ -z "$stack" ] || [ ! -f "$pins" ]; then
  echo "install.sh: no stack '$stack': use --stack newest or --stack oldest (scripts/stacks/*.txt)" >&2
  exit 2
fi
[ "$stack" = oldest ] && venv=${venv:-.venv-oldest}

PY=${PYTHON:-python3}
if [ -n "$venv" ]; then
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  PY=$venv/bin/python
  "$PY" -m pip install --quiet --upgrade pip
fi
# --no-compile: pip would byte-compile every module of torch and transformers (minutes on 2 cores);
# python compiles the ones a run imports, once, on first import
pip_install() {
  PIP_CONSTRAINT="${PIP_CONSTRAINT:+$PIP_CONSTRAINT }$constraints" "$PY" -m pip install --progress-bar off --no-compile "$@"
}

bound=$(sed -nE 's/^ *"torch([<>=!~][^"]*)".*/\1/p' pyproject.toml)  # e.g. >=2.11,<2.16
pin=$(sed -nE 's/^torch==//p' "$pins")
if [ -z "$bound" ] || [ -z "$pin" ]; then
  echo "install.sh: no torch bound in pyproject.toml ('$bound') or no torch pin in $pins ('$pin')" >&2
  exit 1
fi

installed_torch_inside_bound() {  # prints the installed torch's version; fails without one inside
  "$PY" - "$bound" 2>/dev/null <<'EOF'
import operator, re, sys

import torch

def release(version):  # "2.13.0+cpu" -> (2, 13, 0)
    numbers = [int(n) for n in re.match(r"\d+(\.\d+)*", version).group().split(".")]
    return tuple(numbers + [0] * (3 - len(numbers)))

ops = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
       "!=": operator.ne}
clauses = [re.match(r"(>=|<=|==|!=|>|<)(.+)", c.strip()).groups() for c in sys.argv[1].split(",")]
ok = all(ops[op](release(torch.__version__), release(v)) for op, v in clauses)
print(torch.__version__)
sys.exit(0 if ok else 1)
EOF
}

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
grep -vE '^(torch|triton)==' "$pins" > "$constraints"  # the pins torch does not decide
if [ "$stack" = newest ] && version=$(installed_torch_inside_bound); then
  echo "install.sh: keeping the installed torch $version (inside $bound)"
elif command -v nvidia-smi >/dev/null 2>&1; then
  if [ "$stack" = newest ]; then
    pip_install "torch$bound"  # the newest CUDA wheel inside the bound
  else
    cp "$pins" "$constraints"
    pip_install "torch==$pin"
  fi
else
  cp "$pins" "$constraints"
  cpu_index=${TACO_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$cpu_index" 2>/dev/null; then
    pip_install "torch==$pin" --index-url "$cpu_index"
  else
    echo "install.sh: the CPU wheel index $cpu_index is not reachable: torch $pin from the package index"
    pip_install "torch==$pin"
  fi
fi
if ! grep -q '^torch==' "$constraints"; then  # the torch kept or chosen above, whatever its build
  echo "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')" >> "$constraints"
fi
pip_install -e ".[dev]"
"$PY" - "$stack" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version


def installed(name):
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"{name} (none)"


names = ("torch", "triton", "transformers", "accelerate", "peft", "trl", "numpy")
print(f"install.sh: the {sys.argv[1]} stack in {sys.prefix}:", ", ".join(map(installed, names)))
EOF
