#!/usr/bin/env bash
# The test command (make test): lint, then the whole suite; fails when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/ruff" check core plugins tests bench
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=40 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests ran" >&2
  exit 1
fi
exit "$rc"
