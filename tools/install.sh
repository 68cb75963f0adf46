#!/usr/bin/env bash
# One-command install. Why a script: torch must come first and stay pinned (an unpinned `torch`
# pulls a multi-GB CUDA build), and litdata drags in torchvision, whose PyPI wheel does not match
# torch 2.13 and breaks `import lightning` ("operator torchvision::nms does not exist").
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
python -m pip install "torch==${TORCH_VERSION}"
echo "torch==${TORCH_VERSION}" > /tmp/cable_lightning_constraints.txt
python -m pip install -c /tmp/cable_lightning_constraints.txt -e ".[dev,hf]"
python -m pip uninstall -y torchvision >/dev/null 2>&1 || true
python -c "import lightning, litdata, torch, transformers; print(f'cable_lightning ready: torch {torch.__version__}, \
lightning {lightning.__version__}, litdata {litdata.__version__}, transformers {transformers.__version__}')"
