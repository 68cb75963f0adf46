#!/usr/bin/env bash
# The newest releases, checked on purpose, and the lock that records what was tested.
#
#   bash tools/lock.sh check    install the newest releases pyproject's ranges allow into a throwaway virtualenv,
#                               run `ruff check .` and the whole suite there, and print how they differ from
#                               tools/requirements.lock. Changes nothing in the repository.
#   bash tools/lock.sh update   the same, and when the suite passes, write tools/requirements.lock from that
#                               environment (exact versions of everything installed, setuptools included, pip
#                               not; torch without its +cpu tag).
#
# PYTHON picks the interpreter for the virtualenv (default: python3); the lock is only as general as that Python
# and platform (the header says which).
set -euo pipefail
mode="${1:-}"
case "$mode" in
    check | update) ;;
    *) echo "error: unknown mode '${mode}'; valid: bash tools/lock.sh check|update" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
CABLE_LOCK=none bash tools/install.sh
python -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed -e 's/^torch==\([^+]*\)+.*/torch==\1/' \
    | sort -f > "$work/newest"
echo "newest releases allowed (differences from tools/requirements.lock; < locked, > newest):"
diff <(grep -v '^#' tools/requirements.lock 2>/dev/null | sort -f) "$work/newest" || true
ruff check .
python -m pytest tests -q -n 2 > "$work/suite.log" 2>&1 && status=0 || status=$?
tail -n 5 "$work/suite.log"
summary="$(tail -n 1 "$work/suite.log")"
if [ "$status" -ne 0 ]; then
    echo "the newest releases fail the suite (exit ${status}): tools/requirements.lock is unchanged" >&2
    exit 1
fi
if [ "$mode" = update ]; then
    python - "$work/newest" "$summary" > tools/requirements.lock <<'EOF'
import platform, sys
from datetime import date
pins, summary = open(sys.argv[1]).read(), sys.argv[2].strip("= ")
print(f"# Written by `bash tools/lock.sh update` on {date.today()}: the newest releases pyproject.toml allowed, on\n"
      f"# CPython {platform.python_version()} {platform.machine()} {platform.system()}; the suite there: {summary}.\n"
      "# tools/install.sh installs these exact versions (CABLE_LOCK=none: the newest allowed instead).")
print(pins, end="")
EOF
    echo "wrote tools/requirements.lock"
fi
