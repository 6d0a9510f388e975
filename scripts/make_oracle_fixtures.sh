#!/usr/bin/env bash
# Regenerate tests/fixtures/oracle/*.npz from HF transformers' DeepseekV32ForCausalLM, DeepseekV3ForCausalLM and
# GlmMoeDsaForCausalLM (CPU torch).
# Makes .venv-oracle (Python 3.11: this machine's disk has the CPU torch 2.13.0 wheel for it), installs torch,
# transformers, safetensors and numpy there, then runs tests/oracle/make_fixtures.py with any extra arguments
# (e.g. --configs yarn v3_kimi). The project's own .venv (Python >= 3.12, jax) is not touched: the fixtures never
# depend on this project's code.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MIN_TRANSFORMERS=${MIN_TRANSFORMERS:-5.23}
VENV=.venv-oracle

find_python311() {
  local candidates=(python3.11)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.11*/bin/python3.11)
  fi
  candidates+=("$HOME"/.pyenv/versions/3.11*/bin/python3.11 /usr/local/bin/python3.11 /usr/bin/python3.11)
  for py in "${candidates[@]}"; do
    if command -v "$py" >/dev/null 2>&1 \
      && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$py"; return 0
    fi
  done
  echo "make_oracle_fixtures: no Python 3.11 found (the on-disk CPU torch wheel is for 3.11)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  py=$(find_python311)
  echo "make_oracle_fixtures: creating $VENV with $py"
  PYENV_VERSION=$("$py" -c 'import platform; print(platform.python_version())') "$py" -m venv "$VENV"
fi
pip_install() {  # quiet pip; drops this machine's notes about missing local index folders
  "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored" || true; }
  return "${PIPESTATUS[0]}"
}
if ! "$VENV/bin/python" - "$TORCH_VERSION" "$MIN_TRANSFORMERS" <<'PY' 2>/dev/null; then
import sys
import numpy, safetensors, torch, transformers
from transformers import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM  # noqa: F401
have = tuple(int(x) for x in transformers.__version__.split(".")[:2])
need = tuple(int(x) for x in sys.argv[2].split("."))
sys.exit(torch.__version__.split("+")[0] != sys.argv[1] or have < need)
PY
  echo "make_oracle_fixtures: installing torch==$TORCH_VERSION, transformers>=$MIN_TRANSFORMERS into $VENV"
  # torch first and pinned, so transformers' own torch requirement is already met by the CPU build on disk.
  pip_install "torch==$TORCH_VERSION"
  pip_install "transformers>=$MIN_TRANSFORMERS" safetensors numpy "torch==$TORCH_VERSION"
fi

exec "$VENV/bin/python" tests/oracle/make_fixtures.py "$@"
