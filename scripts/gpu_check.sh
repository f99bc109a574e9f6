#!/usr/bin/env bash
# GPU check for HolmesStrategy, for a bare CUDA image with only Python 3 and pip (a few minutes).
#
#   scripts/gpu_check.sh                 # every GPU found: pp=1 FSDP2 on 1 GPU, then pp=2 x dp=N/2 on all N
#   scripts/gpu_check.sh --processes 2   # the last check on 2 GPUs only
#   scripts/gpu_check.sh --device cpu    # the same checks on CPU processes and gloo (no install)
#
# Installs what is missing: a CUDA build of torch (GPU_CHECK_TORCH, default below: PyPI's Linux wheels bring their
# own CUDA runtime and need only the NVIDIA driver), then this checkout's dependencies (`pip install -e .`). Then
# `python3 -m holmes_lightning.cli.gpu_check` prints one line per check; the exit code is non-zero if any failed.
# GPU_CHECK_INSTALL=0 skips the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GPU_CHECK_TORCH:-torch>=2.10,<2.14}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PIP_BREAK_SYSTEM_PACKAGES=1 # images whose system Python is "externally managed" (PEP 668)

cpu_only=0
for arg in "$@"; do
  if [[ "$arg" == "cpu" || "$arg" == "--device=cpu" ]]; then cpu_only=1; fi
done

if [[ "${GPU_CHECK_INSTALL:-1}" != 0 && "$cpu_only" == 0 ]]; then
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    echo "gpu_check: installing $TORCH_SPEC (no CUDA build of torch here)"
    "$PYTHON" -m pip install --quiet --force-reinstall "$TORCH_SPEC"
  fi
  if ! "$PYTHON" -c 'import lightning, hydra, omegaconf, torchmetrics' 2>/dev/null; then
    echo "gpu_check: installing this checkout's dependencies (pip install -e .)"
    "$PYTHON" -m pip install --quiet -e .
  fi
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1 NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # this checkout's code, also in the ranks torchrun starts
exec "$PYTHON" -m holmes_lightning.cli.gpu_check "$@"
