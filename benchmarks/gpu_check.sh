#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, in under 8 minutes (budget per step below):
#   1. the GPU-marked tests (pytest -m gpu)                                   ~1 min
#   2. benchmarks/gpu_check.py: encoding, batched training at M = 100 / 1000,
#      a VPDR round, one round of the per-block-adapter ViT-S/224 (4 clients,
#      3,000 images)                                                          ~3-5 min
# writing benchmarks/results-gpu.json (with the device name).  Usage, from the repository root:
#   bash benchmarks/gpu_check.sh              # the check (fails without a GPU)
#   bash benchmarks/gpu_check.sh --dry-run    # tiny sizes on the CPU: checks the script only
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
if [ "${1:-}" = "--dry-run" ]; then
  exec "$PY" benchmarks/gpu_check.py --dry-run --out "${OUT:-/tmp/protofl-results-gpu-dry.json}"
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA GPU')"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
timeout 150 "$PY" -m pytest -q -m gpu tests/models/test_device.py tests/data/test_features.py
timeout 330 "$PY" benchmarks/gpu_check.py --device cuda --out benchmarks/results-gpu.json
