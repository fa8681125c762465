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
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
reqs=requirements.txt
[ "${1:-}" = "--dev" ] && reqs=requirements-dev.txt
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==${TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}" -r "$reqs"
"$VENV/bin/python" -c "import torch, torchvision; print('torch', torch.__version__, \
'torchvision', torchvision.__version__, 'cuda', torch.cuda.is_available())"
