"""A bystander's inter-token latency while one hostile client sends huge requests, against its own alone.

The hostile client (a process of its own) sends, again and again: a 15 MiB /tokenize (a 47 MB reply on a byte
tokenizer), a completion with 1000 long stop strings (refused by the cap) and a 2M-character prompt (refused by
max_model_len). The bystander streams a greedy completion alone, then under the attack, then alone again; the table
gives its inter-token latency (mean, median, p90, max) in each phase and the attacked / alone ratios (issue 55's
target: at most 2x). Without --url it starts `dcp-jax serve` of dsa-tiny on loopback with scripts/serve_demo.sh's
engine settings; on a 2-core machine the hostile process and the server share the cores.

    .venv/bin/python bench/bench_fairness.py --out /tmp/fairness.json
    .venv/bin/python bench/bench_fairness.py --url http://127.0.0.1:8000 --bystander-tokens 300
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, str(ROOT))

# scripts/serve_demo.sh's engine settings (its compilation cache serves both).
SERVE_DEMO_ARGS = ["--dcp", "2", "--interleave", "2", "--max-model-len", "352", "--page-size", "4",
                   "--buckets", "8", "--max-num-batched-tokens", "64"]

# The hostile client: argv[1] is the port; prints each reply's path and status.
HOSTILE_CLIENT = """
import http.client, json, sys
bodies = [("/tokenize", {"prompt": "a" * (15 << 20)}),
          ("/v1/completions", {"prompt": "hi", "stop": ["x" * 400 + str(i) for i in range(1000)]}),
          ("/v1/completions", {"prompt": "b" * 2_000_000, "max_tokens": 4})]
bodies = [(path, json.dumps(body)) for path, body in bodies]
while True:
    for path, body in bodies:
        connection = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=300)
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        reply.read()
        print(path, reply.status, flush=True)
"""


def inter_token_latencies(port: int, max_tokens: int) -> list[float]:
    """Seconds between consecutive chunks of one streamed greedy completion of exactly max_tokens tokens."""
    body = json.dumps({"prompt": [[5, 6, 7]], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    arrivals, received = [], b""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while b"data: [DONE]" not in received and (chunk := sock.recv(65536)):
            received += chunk  # (an event may arrive in two pieces, or with the next ones)
            arrivals += [time.perf_counter()] * (received.count(b"data: {") - len(arrivals))
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


def measure(port: int, bystander_tokens: int = 300, hostile_replies: int = 3) -> dict:
    """The bystander alone (half its tokens before the attack, half after) and under attack; the hostile client's
    first `hostile_replies` replies (path, status) as it saw them."""
    inter_token_latencies(port, 20)  # warm
    alone = inter_token_latencies(port, bystander_tokens // 2)
    hostile = subprocess.Popen([sys.executable, "-c", HOSTILE_CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        replies = [hostile.stdout.readline().split()]  # the attack is under way
        attacked = inter_token_latencies(port, bystander_tokens)
        replies += [hostile.stdout.readline().split() for _ in range(hostile_replies - 1)]
    finally:
        hostile.kill()
        hostile.wait(60)
    time.sleep(2)  # the server's work for the last hostile request ends
    alone += inter_token_latencies(port, bystander_tokens // 2)
    row = dict(hostile_replies=[" ".join(reply) for reply in replies])
    for name, gaps in (("alone", alone), ("attacked", attacked)):
        ordered = sorted(gaps)
        row[name] = dict(tokens=len(gaps) + 1, mean_ms=1e3 * statistics.mean(gaps),
                         median_ms=1e3 * statistics.median(gaps), p90_ms=1e3 * ordered[int(0.9 * len(gaps))],
                         max_ms=1e3 * ordered[-1])
    row["mean_ratio"] = row["attacked"]["mean_ms"] / row["alone"]["mean_ms"]
    row["median_ratio"] = row["attacked"]["median_ms"] / row["alone"]["median_ms"]
    return row


def table(row: dict) -> str:
    lines = ["| phase | mean ms | median ms | p90 ms | max ms |", "|---|---|---|---|---|"]
    lines += [f"| {phase} | {s['mean_ms']:.1f} | {s['median_ms']:.1f} | {s['p90_ms']:.1f} | {s['max_ms']:.1f} |"
              for phase, s in ((p, row[p]) for p in ("alone", "attacked"))]
    lines.append(f"attacked / alone: mean {row['mean_ratio']:.2f}x, median {row['median_ratio']:.2f}x (target <= 2x)")
    return "\n".join(lines)


def serve_dsa_tiny(compilation_cache_dir: str | None) -> tuple[subprocess.Popen, int]:
    """`dcp-jax serve` of dsa-tiny on a free loopback port, once ready."""
    cache = ["--compilation-cache-dir", compilation_cache_dir] if compilation_cache_dir else []
    proc = subprocess.Popen([sys.executable, "-m", "dcp_jax.cli", "serve", "--port", "0", *cache, *SERVE_DEMO_ARGS],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = None
    for line in proc.stdout:
        if match := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
            port = int(match.group(1))
        if line.startswith("dcp-jax serve: ready:"):
            # The server's log keeps flowing, read and dropped, so the pipe never fills.
            threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
            return proc, port
    raise RuntimeError("dcp-jax serve exited before it was ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start dsa-tiny on loopback)")
    parser.add_argument("--bystander-tokens", type=int, default=300, help="tokens the bystander streams attacked")
    parser.add_argument("--compilation-cache-dir", default=None)
    parser.add_argument("--out", default=None, help="JSON output")
    args = parser.parse_args(argv)
    proc = None
    if args.url:
        port = urlparse(args.url).port
    else:
        proc, port = serve_dsa_tiny(args.compilation_cache_dir)
    try:
        row = measure(port, args.bystander_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    from bench.common import run_info

    row = dict(run_info(), **row)
    print(table(row))
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
