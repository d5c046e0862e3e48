#!/usr/bin/env bash
# The device path in one go, for the first machine with a GPU (NVIDIA or ROCm: torch's `cuda`):
#   1. every test marked `gpu` (pytest -m gpu; they skip without a GPU, so this fails loudly if none ran)
#   2. the device benchmark: bench_kvtransfer's staged rows with both pools on the GPU (pinned stages,
#      side-stream copies), next to the raw socket and the CPU-pool TCP path of the same run
# A few minutes in all. Usage: scripts/gpu_check.sh [python]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [ -z "$PY" ]; then PY=.venv/bin/python; [ -x "$PY" ] || PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no GPU (torch.cuda.is_available() is False): nothing to check" >&2
    exit 2
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__,
      "hip" if torch.version.hip else "cuda", torch.version.hip or torch.version.cuda)'

echo "== gpu tests"
out=$(mktemp)
set +e
"$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then echo "gpu_check: gpu tests FAILED (rc $rc)"; exit "$rc"; fi
if grep -q "skipped" "$out" && ! grep -q "passed" "$out"; then echo "gpu_check: every gpu test skipped"; exit 1; fi

echo "== device benchmark (bench_kvtransfer, staged pools on cuda)"
"$PY" bench/bench_kvtransfer.py --device cuda --tokens 20000 --rounds 5 --layouts default-bf16,glm5 \
    --only "kv no-crc,kv staged"
echo "gpu_check: PASS"
