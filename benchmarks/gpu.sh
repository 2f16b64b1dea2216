#!/usr/bin/env bash
# The GPU checks in one run: the tests marked cuda, then the retention, capture and staging
# benchmarks with --device cuda. Writes logs and JSON documents to OUT_DIR and a summary line
# per step; exits non-zero when there is no CUDA device or any step failed.
#
#   bash benchmarks/gpu.sh [OUT_DIR]        (default: ./gpu-results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-results}"
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" > "$out/device.txt" 2>&1; then
    echo "gpu.sh: no usable CUDA device: $(tail -1 "$out/device.txt")" >&2
    exit 1
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
status=0
"$PYTHON" -m pytest -m cuda -p no:cacheprovider -q > "$out/cuda-tests.txt" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
echo "cuda tests: rc=$rc ($(tail -1 "$out/cuda-tests.txt"))" | tee -a "$out/summary.txt"
for bench in retention capture staging; do
    "$PYTHON" -m "benchmarks.$bench" --device cuda --json > "$out/$bench.json" 2> "$out/$bench.err"
    rc=$?; [ $rc -eq 0 ] || status=1
    echo "benchmarks.$bench --device cuda: rc=$rc" | tee -a "$out/summary.txt"
done
exit $status
