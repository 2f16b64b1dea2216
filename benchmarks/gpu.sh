#!/usr/bin/env bash
# The GPU checks in one run: the tests marked cuda, then the retention, capture and staging
# benchmarks with --device cuda. Writes logs and JSON documents to OUT_DIR and a summary line
# per step; exits non-zero when there is no CUDA device or any step failed.
#
#   bash benchmarks/gpu.sh [OUT_DIR]        (default: ./gpu-results)
#
# Environment:
#   PYTHON   the interpreter that holds a CUDA build of torch (default: python3)
#   WHEELS   a folder of wheels to install first, for packages the machine lacks and cannot
#            download (an offline GPU host: pyzmq, gymnasium); installed with --no-deps into a
#            temporary folder put on PYTHONPATH, nothing of the machine's own is replaced.
#            Default: ./.whl where it exists.
#   DEVICE   cuda (default), or cpu to try the script itself on a machine without a GPU (the
#            cuda tests are then all skipped, and the benchmarks run on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-results}"
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
export PYTHONUNBUFFERED=1
wheels="${WHEELS:-.whl}"
if [ -d "$wheels" ] && compgen -G "$wheels/*.whl" > /dev/null; then
    site="$(mktemp -d)"
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
            "$wheels"/*.whl > "$out/wheels.txt" 2>&1; then
        echo "gpu.sh: installing the wheels of $wheels failed: $(tail -1 "$out/wheels.txt")" >&2
        exit 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DEVICE" = cuda ]; then
    if ! "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" > "$out/device.txt" 2>&1; then
        echo "gpu.sh: no usable CUDA device: $(tail -1 "$out/device.txt")" >&2
        exit 1
    fi
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
fi
status=0
# Only the test files with cuda tests: the others import what a GPU host may lack (zarr, moto...).
mapfile -t files < <(grep -rl --include='test_*.py' -e 'mark\.cuda' tests | sort)
if [ "${#files[@]}" -eq 0 ]; then
    echo "gpu.sh: no test file has a cuda test" >&2
    exit 1
fi
"$PYTHON" -m pytest -m cuda -p no:cacheprovider -q "${files[@]}" > "$out/cuda-tests.txt" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
echo "cuda tests (${#files[@]} files): rc=$rc ($(tail -1 "$out/cuda-tests.txt"))" | tee -a "$out/summary.txt"
for bench in retention capture staging; do
    "$PYTHON" -m "benchmarks.$bench" --device "$DEVICE" --json > "$out/$bench.json" 2> "$out/$bench.err"
    rc=$?; [ $rc -eq 0 ] || status=1
    echo "benchmarks.$bench --device $DEVICE: rc=$rc" | tee -a "$out/summary.txt"
done
exit $status
