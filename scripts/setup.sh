#!/usr/bin/env bash
# Make .venv with a Python >= 3.12 (on PATH or under pyenv) and install dcp-jax with jax/jaxlib 0.11.2.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidates=(python3.13 python3.12 python3)
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    candidates+=("$root"/versions/3.1[2-9]*/bin/python3 "$root"/versions/3.1[2-9]*/bin/python3.1[2-9])
  fi
  candidates+=("$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9])
  for py in "${candidates[@]}"; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$py"; return 0
    fi
  done
  echo "setup: no Python >= 3.12 found on PATH or under pyenv" >&2
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  py=$(find_python)
  echo "setup: creating .venv with $py"
  rm -rf .venv
  PYENV_VERSION=$("$py" -c 'import platform; print(platform.python_version())') "$py" -m venv .venv
fi
pip_install() {  # quiet pip; drops this machine's notes about missing local index folders
  .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "is ignored" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install --upgrade pip
pip_install -e ".[dev]"
.venv/bin/python -c 'import jax; assert jax.__version__ == "0.11.2", jax.__version__'
echo "setup: ready (.venv, jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
