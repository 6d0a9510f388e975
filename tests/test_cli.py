"""The `dcp-jax` commands the README runs: `demo`, and `scripts/serve_demo.sh` (serve + one request)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_serve_help_imports_no_benchmark_and_no_jax():
    """`dcp-jax serve --help` builds its parser from the library alone: no bench/ module, and not even jax."""
    code = ("import sys\nfrom dcp_jax import cli\ntry:\n    cli.main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "bad = sorted(m for m in sys.modules if m == 'bench' or m.startswith(('bench.', 'jax')))\n"
            "print(bad, file=sys.stderr)\nsys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--max-model-len" in done.stdout


def test_bench_names_what_it_has(capsys):
    assert cli.main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "'decode'" in err


@pytest.mark.parametrize("content, message", [(None, "no such file"), ("{not json", "Expecting property name"),
                                              ("[1, 2]", "not a JSON object"), ('{"vocab_size": 10}', "lacks")])
def test_generate_names_a_bad_model_directory_in_one_line(tmp_path, capsys, content, message):
    """A directory without config.json, or with a broken one: one error line naming the file, exit 2."""
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dcp-jax generate: {tmp_path / 'config.json'}: ") and message in err, err
    assert "Traceback" not in err
