"""The `dcp-jax` commands the README runs: `demo`, and `scripts/serve_demo.sh` (serve + one request)."""

import json
import os
import subprocess
from pathlib import Path

from dcp_jax import cli

ROOT = Path(__file__).resolve().parents[1]


def test_demo_compares_the_sharded_stack_with_the_single_device_one(capsys):
    assert cli.main(["demo", "--dcp", "1,2", "--steps", "12", "--max-seqs", "2"]) == 0
    out = capsys.readouterr().out
    assert "sharded == single-device: yes" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]


def test_readme_serve_demo_answers_a_completion(tmp_path):
    env = dict(os.environ, DCP_JAX_CACHE=str(tmp_path / "xla"))
    env.pop("XLA_FLAGS", None)  # the server picks its own simulated devices
    done = subprocess.run(["bash", str(ROOT / "scripts" / "serve_demo.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout[done.stdout.index("{"):])
    assert reply["object"] == "text_completion"
    assert reply["usage"]["completion_tokens"] == 16
