#!/usr/bin/env bash
# One-command install into the active Python environment (a virtualenv is best: see the README).
#
# Why a script: torch must come first and stay pinned (an unpinned `torch` pulls a multi-GB CUDA build), litdata
# drags in torchvision, whose PyPI wheel does not match torch 2.13 and breaks `import lightning` ("operator
# torchvision::nms does not exist"), and every other package comes at the version in tools/requirements.lock, the
# versions the suite passed with, so two installs a month apart get the same packages.
#
#   CABLE_LOCK=FILE   another lock; CABLE_LOCK=none: the newest releases pyproject's ranges allow (tools/lock.sh)
#   TORCH_VERSION=V   another torch build (default: the lock's, or 2.13.0 without one)
#   TORCH_VERSION=installed   keep the torch this Python already has (a CUDA build on a GPU machine), pinned as it is
set -euo pipefail
cd "$(dirname "$0")/.."
keep=""  # packages left as installed, unpinned: the kept torch's own requirements (torch 2.11 needs setuptools<82)
if [ "${TORCH_VERSION:-}" = installed ]; then
    # the distribution's version (a PyPI CUDA build is 2.11.0; torch.__version__ says 2.11.0+cu130)
    TORCH_VERSION="$(python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" \
        || { echo "error: TORCH_VERSION=installed, but $(command -v python) has no torch to keep" >&2; exit 2; }
    keep="$(python -c 'import importlib.metadata as m, re
print(" ".join(re.split(r"[^A-Za-z0-9._-]", r, maxsplit=1)[0].lower().replace("_", "-")
               for r in m.requires("torch") or [] if "extra ==" not in r))')"
fi
LOCK="${CABLE_LOCK:-tools/requirements.lock}"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
if [ "$LOCK" = none ]; then
    TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
else
    [ -f "$LOCK" ] || { echo "error: lock file $LOCK does not exist; valid: a file from tools/lock.sh, or CABLE_LOCK=none" >&2; exit 2; }
    # every line a pin (name==version), else pip's own error names the temporary constraints file, not the lock
    bad="$(awk '!/^[[:space:]]*(#|$)/ && !/^[A-Za-z0-9][A-Za-z0-9._-]*==[^[:space:]=]+$/ { print FNR ": " $0; exit }' "$LOCK")"
    [ -z "$bad" ] || { echo "error: $LOCK:$bad is not a pin (name==version); fix that line, or write the lock again with bash tools/lock.sh update" >&2; exit 2; }
    locked_torch="$(sed -n 's/^torch==//p' "$LOCK")"
    TORCH_VERSION="${TORCH_VERSION:-${locked_torch:-2.13.0}}"
    grep -v '^torch==' "$LOCK" | awk -v keep=" $keep " '{ name = tolower($0); sub(/==.*/, "", name); gsub(/_/, "-", name)
        if (index(keep, " " name " ") == 0) print }' > "$constraints"
fi
echo "torch==${TORCH_VERSION}" >> "$constraints"
python -m pip install -c "$constraints" "torch==${TORCH_VERSION}"
python -m pip install -c "$constraints" -e ".[dev,hf]"
python -m pip uninstall -y torchvision >/dev/null 2>&1 || true
python -c "import lightning, litdata, torch, transformers; print(f'cable_lightning ready: torch {torch.__version__}, \
lightning {lightning.__version__}, litdata {litdata.__version__}, transformers {transformers.__version__} ($LOCK)')"
