#!/usr/bin/env bash
# paged-tpu end to end on XLA:CPU (PJRT_DEVICE=CPU), in its own virtual environment:
# torch-xla 2.9.0 needs torch 2.9.0 exactly, the main venv has a newer torch.
#
# PyPI's only torch 2.9.0 for x86_64 is the CUDA build: the venv takes about 7 GB and a cold
# install 3-5 minutes here; it is reused when present, so keeping $XLA_VENV (default
# .venv-xla) between runs leaves the check itself (under a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${XLA_VENV:-.venv-xla}
PY="$VENV/bin/python"
pip_install() { # quiet, less the warnings about this machine's local package indexes
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}

if [ ! -f "$VENV/.xla-installed" ]; then
  test -x "$PY" || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
  echo '*' >"$VENV/.gitignore" # never committed, wherever it lives
  t0=$SECONDS
  pip_install torch==2.9.0 torch-xla==2.9.0
  # paged's own dependencies, less torch (pinned above).
  mapfile -t deps < <("$PY" -c '
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))')
  pip_install "${deps[@]}"
  echo "xla venv installed in $((SECONDS - t0)) s"
  touch "$VENV/.xla-installed"
fi
# Editable and without dependencies, pointing at this checkout (the venv may be cached from
# another one); redone when the checkout or a pyproject.toml changes.
key="$(pwd -P) $(cat pyproject.toml plugins/cpu/pyproject.toml plugins/tpu/pyproject.toml | sha256sum)"
if [ "$(cat "$VENV/.paged-editable" 2>/dev/null)" != "$key" ]; then
  pip_install --no-deps -e . -e plugins/cpu -e plugins/tpu
  echo "$key" >"$VENV/.paged-editable"
fi

export PJRT_DEVICE=CPU HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" plugins/tpu/check_xla.py "$@"
