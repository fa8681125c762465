#!/usr/bin/env bash
# Train on one node with every local device.
#   ./run_single.sh                      # built-in demo data (no download), output in runs/demo
#   ./run_single.sh /data/imagenet -a resnet50 -b 256
# More than one visible GPU: main.py starts one DDP process per GPU (-b is then per node).
# Environment: PYTHON (default .venv/bin/python, else python3), OUTPUT_DIR (default runs/<name>),
# NPROC (CPU-only: processes to start, default 1).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$here/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
args=()
if [ $# -eq 0 ] || [[ "$1" == -* ]]; then
    args+=(--demo --output-dir "${OUTPUT_DIR:-runs/demo}")
else
    data=$1; shift
    args+=("$data" --output-dir "${OUTPUT_DIR:-runs/$(basename "$data")}")
fi
if [ "${NPROC:-1}" -gt 1 ]; then
    args+=(--multiprocessing-distributed --nproc-per-node "$NPROC")
fi
exec "$PYTHON" "$here/main.py" "${args[@]}" "$@"
