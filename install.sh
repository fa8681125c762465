#!/usr/bin/env bash
# Create .venv with the tested torch/torchvision pair and the runtime dependencies.
#   bash install.sh          # to train
#   bash install.sh --dev    # plus pytest and ruff, to run the tests
# torch and torchvision are installed as an exact pair: a torchvision built for another torch
# fails at import ("operator torchvision::nms does not exist").
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
# torch's CUDA build, torchvision and (with --dev) the extras take ~7 GB: a disk with less free
# ends pip half way with "[Errno 28] No space left on device"; say so before it starts.
if [ ! -d "$VENV/lib" ] || ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
    if [ "${free_kb:-0}" -lt $((7 * 1024 * 1024)) ]; then
        echo "install.sh: $((free_kb / 1024)) MB free on the disk of $VENV; torch, torchvision" \
             "and the extras need ~7 GB: free some space (or set VENV=/a/larger/disk/venv)" >&2
        exit 1
    fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
reqs=requirements.txt
[ "${1:-}" = "--dev" ] && reqs=requirements-dev.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    "torch==${TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}" -r "$reqs"
"$VENV/bin/python" -c "import torch, torchvision; print('torch', torch.__version__, \
'torchvision', torchvision.__version__, 'cuda', torch.cuda.is_available())"
