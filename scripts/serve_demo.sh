#!/usr/bin/env bash
# Set up, start the OpenAI-compatible server on the embedded tiny model with DCP=2 over simulated CPU devices
# (loopback, a free port), wait for /health, send one completion, print it, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
log=$(mktemp)
.venv/bin/dcp-jax serve --dcp 2 --interleave 2 --port 0 --max-model-len 128 --page-size 4 --buckets 8 \
  --max-num-batched-tokens 16 \
  --compilation-cache-dir "${DCP_JAX_CACHE:-$HOME/.cache/dcp-jax/xla}" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
url=""
for _ in $(seq 600); do
  url=$(grep -o 'listening on http://[0-9.:]*' "$log" | awk '{print $3}' || true)
  [ -n "$url" ] && curl -sf "$url/health" >/dev/null && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.5
done
grep '^dcp-jax serve:' "$log"
echo "POST $url/v1/completions"
curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "tiny", "prompt": "Hello, DCP!", "max_tokens": 16, "temperature": 0}' |
  .venv/bin/python -m json.tool
