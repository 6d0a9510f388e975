#!/usr/bin/env bash
# Run the test suite on 8 simulated CPU devices (sets up .venv first when needed): one worker a core (at most 4),
# each taking whole test files (grouped as tests/conftest.py says). The slow tests, which repeat what faster ones
# cover at other sizes, are left out: `bash scripts/test.sh -m ""` runs everything, `-m slow` only them.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "import pytest, xdist" 2>/dev/null || bash scripts/setup.sh
# The tests compile far more than they run: at LLVM's optimization level 0 the whole suite took 11.1 min against
# 13.8 on a 2-core machine (child processes that pick their own devices keep it: tests/child_env.py).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup -m "not slow" "$@"
