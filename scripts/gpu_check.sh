#!/usr/bin/env bash
# GPU check for HolmesStrategy: its real path on one GPU (estimated 3 minutes on one H200), pp=2 on several GPUs.
#
#   scripts/gpu_check.sh                 # every check; multi_gpu on up to 8 GPUs, skipped on one
#   scripts/gpu_check.sh --processes 2   # multi_gpu on 2 GPUs only
#   scripts/gpu_check.sh --device cpu    # the same checks on CPU processes and gloo
#
# `python3 -m holmes_lightning.cli.gpu_check` prints one line per check (its docstring says what each does); the exit
# code is non-zero if any failed. The jobs write under $TMPDIR (a ~15 GB checkpoint on GPUs).
# For a bare image with only Python 3 and pip, it first installs what is missing: lightning, torchmetrics, hydra-core
# and omegaconf (the ranges pyproject.toml requires) with the installed torch pinned, so pip never replaces it; torch
# itself (GPU_CHECK_TORCH, default below: PyPI's Linux wheels bring their own CUDA runtime and need only the NVIDIA
# driver) only where there is none. GPU_CHECK_INSTALL=0 installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GPU_CHECK_TORCH:-torch>=2.10,<2.14}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PIP_BREAK_SYSTEM_PACKAGES=1 # images whose system Python is "externally managed" (PEP 668)

# module to import -> what pip installs where it is missing (as pyproject.toml's dependencies)
missing_requirements() {
  "$PYTHON" - <<'PY'
import importlib.util

wanted = {
    "lightning": "lightning>=2.4,<2.7",
    "torchmetrics": "torchmetrics>=1.0",
    "hydra": "hydra-core>=1.3",
    "omegaconf": "omegaconf>=2.3",
}
print(" ".join(spec for module, spec in wanted.items() if importlib.util.find_spec(module) is None))
PY
}

if [[ "${GPU_CHECK_INSTALL:-1}" != 0 ]]; then
  if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "gpu_check: installing $TORCH_SPEC (no torch here)"
    "$PYTHON" -m pip install --quiet "$TORCH_SPEC"
  fi
  read -r -a missing <<<"$(missing_requirements)"
  if ((${#missing[@]})); then
    constraints="$(mktemp)"
    "$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' >"$constraints"
    echo "gpu_check: installing ${missing[*]} ($(cat "$constraints") stays)"
    "$PYTHON" -m pip install --quiet --constraint "$constraints" "${missing[@]}"
    rm -f "$constraints"
  fi
fi

export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # this checkout's code, also in the ranks torchrun starts
exec "$PYTHON" -m holmes_lightning.cli.gpu_check "$@"
