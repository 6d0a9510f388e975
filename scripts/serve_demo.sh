#!/usr/bin/env bash
# Set up, start the OpenAI-compatible server on the shipped trained model (dsa-tiny) with DCP=2 over simulated CPU
# devices (loopback, a free port), wait for /health, ask one retrieval question past index_topk (one record among 25,
# 308 tokens), print the answer and whether it is right, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
log=$(mktemp)
.venv/bin/dcp-jax serve --dcp 2 --interleave 2 --port 0 --max-model-len 352 --page-size 4 --buckets 8 \
  --max-num-batched-tokens 64 \
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
.venv/bin/python - "$url" <<'PY'
import json
import sys
import urllib.request

import numpy as np

from dcp_jax.train.retrieval import ANSWER_BYTES, make_example, records_for

prompt, answer = make_example(np.random.default_rng(2026), records_for(320))
body = {"model": "dsa-tiny", "prompt": prompt, "max_tokens": ANSWER_BYTES, "temperature": 0}
request = urllib.request.Request(f"{sys.argv[1]}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=300))
text = reply["choices"][0]["text"]
print(json.dumps(reply, indent=2))
print(f"prompt: {prompt[:48]}... ({reply['usage']['prompt_tokens']} tokens) ...{prompt[-24:]}")
print(f"answer: {text!r}, expected {answer!r}: {'right' if text == answer else 'WRONG'}")
sys.exit(0 if text == answer else 1)
PY
