#!/usr/bin/env bash
# Run the test suite on 8 simulated CPU devices (sets up .venv first when needed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
exec .venv/bin/python -m pytest -q "$@"
