#!/usr/bin/env bash
# Run the GPU-marked tests (`pytest -m gpu`) compiled on a CUDA GPU; extra arguments go to pytest (`-k mosaic`, `-x`,
# test paths: these replace the default, every file holding GPU tests).
# Uses the first Python >= 3.12 whose jax 0.11.2 sees a GPU: $PYTHON, .venv/bin/python, python3.12, python3.13,
# python3 (the GPU machines' system python3 has jax 0.11.2 with the CUDA 13 plugin). JAX_CUDA=cuda13 (or cuda12)
# first installs `jax[cuda13]==0.11.2` into .venv, where a registry can be reached. Refuses (exit 2) when no GPU is
# visible, and fails when every selected test was skipped, so a machine without one never passes silently.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${JAX_CUDA:-}" ]; then
  [ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
  .venv/bin/python -m pip install -q "jax[$JAX_CUDA]==0.11.2" || exit 1
fi

# Prints nothing when `$1` is a Python >= 3.12 with jax 0.11.2 on a GPU backend, else why not.
why_not() {
  "$1" - <<'EOF' 2>/dev/null || echo "does not run"
import sys
if sys.version_info < (3, 12):
    sys.exit(print(f"Python {sys.version.split()[0]} < 3.12"))
try:
    import jax
except ImportError:
    sys.exit(print("no jax"))
if jax.__version__ != "0.11.2":
    sys.exit(print(f"jax {jax.__version__} != 0.11.2"))
try:
    backend = jax.default_backend()
except RuntimeError as e:
    backend = f"none ({e})"
if backend != "gpu":
    print(f"jax sees no GPU (backend {backend})")
EOF
}

py="" checked=""
for candidate in ${PYTHON:-} .venv/bin/python python3.12 python3.13 python3; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  reason=$(why_not "$candidate")
  if [ -z "$reason" ]; then py=$candidate; break; fi
  checked+="  $candidate: $reason"$'\n'
done
if [ -z "$py" ]; then
  echo "test_gpu: refusing to run: no Python >= 3.12 with a GPU-enabled jax 0.11.2 sees a CUDA GPU here." >&2
  printf '%s' "$checked" >&2
  exit 2
fi

# The test paths given, else only the files holding GPU tests: collecting the rest would import the serving stack's
# packages (fastapi, ...), which a GPU machine need not have.
has_path=0
for arg in "$@"; do [[ "$arg" == tests* && -e "${arg%%::*}" ]] && has_path=1; done
files=()
[ "$has_path" = 1 ] || mapfile -t files < <(grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)
mkdir -p out
echo "test_gpu: $py (jax $("$py" -c 'import jax; print(jax.__version__, jax.devices())'))"
PYTHONPATH=. "$py" -m pytest -m gpu -p no:cacheprovider -o junit_family=xunit1 --junitxml=out/test_gpu.xml \
  "${files[@]}" "$@"
rc=$?
[ "$rc" -ne 0 ] && exit "$rc"
"$py" - <<'EOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse("out/test_gpu.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
if tests - skipped <= 0:
    sys.exit(f"test_gpu: every selected test was skipped ({tests} selected): nothing ran on the GPU")
print(f"test_gpu: {tests - skipped} of {tests} selected tests ran on the GPU")
EOF
