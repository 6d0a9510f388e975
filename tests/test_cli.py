"""The `dcp-jax` commands the README runs: `demo`, `scripts/serve_demo.sh` (serve + one request), and `serve`'s
lifecycle as a process: a bad address fails before any loading, SIGTERM drains the streams in flight."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import bench_fairness
from dcp_jax import cli
from dcp_jax.config import PRESETS, shipped_checkpoints
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
SERVE_DEMO_ARGS = bench_fairness.SERVE_DEMO_ARGS


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla")


def test_demo_compares_the_sharded_stack_with_the_single_device_one(capsys):
    assert cli.main(["demo", "--dcp", "1,2", "--steps", "12", "--max-seqs", "2"]) == 0
    out = capsys.readouterr().out
    assert "sharded == single-device: yes" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]


def test_readme_serve_demo_answers_the_retrieval_question_right(xla_cache):
    env = child_env(DCP_JAX_CACHE=str(xla_cache))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "serve_demo.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reply = json.loads(done.stdout[done.stdout.index("{"): done.stdout.rindex("}") + 1])
    assert reply["object"] == "text_completion" and reply["model"] == "dsa-tiny"
    assert reply["usage"]["prompt_tokens"] > 64  # past index_topk: the selection decides the answer
    answer = re.search(r"answer: '(.*)', expected '(.*)': right", done.stdout)
    assert answer and answer.group(1) == answer.group(2) == reply["choices"][0]["text"], done.stdout


def serve_process(*args, env=None):
    env = child_env(**(env or {}))
    return subprocess.Popen([sys.executable, "-m", "dcp_jax.cli", "serve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("port, message", [(70000, "the port must be in [0, 65535]"),
                                           ("busy", "Address already in use")])
def test_serve_fails_on_a_bad_address_in_one_line_before_loading(port, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1] if port == "busy" else port
        proc = serve_process("--port", str(port), "--model", "/no/such/model")  # a load would fail otherwise
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dcp-jax serve: cannot listen on 127.0.0.1:{port}: "), out
    assert message in lines[0]


def test_a_bad_model_is_one_line_and_exit_2_after_binding():
    proc = serve_process("--port", "0", "--model", "/no/such/model")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert out.splitlines()[0].startswith("dcp-jax serve: listening on http://127.0.0.1:")
    assert out.strip().splitlines()[-1] == (f"dcp-jax serve: model '/no/such/model' is neither a directory, a "
                                            f"shipped checkpoint {shipped_checkpoints()} nor a preset "
                                            f"{sorted(PRESETS)}")


def read_until(proc, pattern: str, lines: list[str], timeout: float = 300.0) -> re.Match:
    """Read the process's output lines (into `lines`) until one matches `pattern`; a hang guard, not a timer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if match := re.search(pattern, line):
            return match
    pytest.fail(f"no line matching {pattern!r}:\n" + "".join(lines[-40:]))


def stream_completion(port: int, prompt: list[int], max_tokens: int, started: threading.Event, out: dict) -> None:
    """One streamed completion over a raw socket; `out["data"]` is everything the server sent."""
    body = json.dumps({"model": "dsa-tiny", "prompt": [prompt], "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"data: {" in data:
                started.set()
        out["data"] = data.decode()


@pytest.fixture(scope="module")
def served(xla_cache):
    """A `dcp-jax serve` process of dsa-tiny, ready: (process, port, its output lines so far). The SIGTERM test,
    this file's last to use it, ends it."""
    proc = serve_process("--port", "0", "--compilation-cache-dir", str(xla_cache), "--shutdown-timeout", "1",
                         *SERVE_DEMO_ARGS)
    lines = []
    try:
        port = int(read_until(proc, r"listening on http://127\.0\.0\.1:(\d+)", lines).group(1))
        read_until(proc, r"^dcp-jax serve: ready:", lines)
        yield proc, port, lines
    finally:
        proc.kill()
        proc.wait(60)


def test_a_hostile_client_hurts_no_bystander(served):
    """While one client sends huge bodies again and again (15 MiB to tokenize, 1000 long stop strings, a 2M-character
    prompt: bench/bench_fairness.py, which measures the bystander's latency), each of those gets its answer (the
    tokens; 400s for the two over the caps) and a bystander's streams get every token."""
    _, port, _ = served
    row = bench_fairness.measure(port, bystander_tokens=60)
    assert set(row["hostile_replies"]) <= {"/tokenize 200", "/v1/completions 400"}, row
    assert row["alone"]["tokens"] == 2 * 29 + 1 and row["attacked"]["tokens"] == 60, row


def test_sigterm_drains_the_streams_in_flight_and_exits_0(served):
    """SIGTERM with 4 streams in flight: no new connections, a request that arrives then is a 503, the short streams
    finish, the long ones are aborted after --shutdown-timeout; every one ends with a final chunk and [DONE]; every
    page free; exit 0, logged."""
    proc, port, lines = served
    try:
        results = [{} for _ in range(4)]
        started = [threading.Event() for _ in results]
        threads = [threading.Thread(target=stream_completion, args=(port, [5 + i, 6, 7], 8 if i < 2 else 120,
                                                                    started[i], results[i])) for i in range(4)]
        for t in threads:
            t.start()
        assert all(event.wait(120) for event in started)
        # A request whose head arrived before the signal and whose body after it: the documented 503.
        body = json.dumps(dict(prompt=[5, 6], max_tokens=2)).encode()
        late = socket.create_connection(("127.0.0.1", port), timeout=30)
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        read_until(proc, r"SIGTERM: draining", lines)
        late.sendall(body)
        reply = b""
        while chunk := late.recv(65536):  # the server closes the connection after it
            reply += chunk
        late.close()
        reply = reply.decode()
        assert reply.startswith("HTTP/1.1 503") and "the server is shutting down" in reply, reply
        for t in threads:
            t.join(120)
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
    finally:
        proc.kill()
    assert proc.returncode == 0, "".join(lines[-40:])
    for i, result in enumerate(results):
        events = [line[6:] for line in result["data"].splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (i, result["data"][-500:])
        final = json.loads(events[-2])["choices"][0]
        assert final["finish_reason"] in (("length",) if i < 2 else ("length", "abort")), (i, final)
    log = "".join(lines)
    assert "SIGTERM: draining" in log
    pages = re.search(r"stopped: (\d+) of (\d+) KV pages free", log)
    assert pages and pages.group(1) == pages.group(2), log[-3000:]
    with pytest.raises(OSError):  # nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_serve_help_imports_no_benchmark_and_no_jax():
    """`dcp-jax serve --help` builds its parser from the library alone: no bench/ module, and not even jax."""
    code = ("import sys\nfrom dcp_jax import cli\ntry:\n    cli.main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "bad = sorted(m for m in sys.modules if m == 'bench' or m.startswith(('bench.', 'jax')))\n"
            "print(bad, file=sys.stderr)\nsys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--max-model-len" in done.stdout


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_enable_expert_parallel_parses_on_generate_and_serve(command):
    parser = cli.build_parser()
    assert parser.parse_args(command).enable_expert_parallel is False
    assert parser.parse_args(command + ["--tp", "4", "--enable-expert-parallel"]).enable_expert_parallel is True


def test_generate_passes_enable_expert_parallel_to_the_llm(monkeypatch, capsys):
    import dcp_jax.serving.llm

    seen = {}

    def refuse(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(dcp_jax.serving.llm, "LLM", refuse)
    assert cli.main(["generate", "--prompt", "hi", "--tp", "4", "--enable-expert-parallel"]) == 2
    assert seen["enable_expert_parallel"] is True and seen["tp"] == 4
    assert "stop here" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_hf_overrides_parse_as_a_json_object(command, capsys):
    parser = cli.build_parser()
    assert parser.parse_args(command).hf_overrides is None
    assert parser.parse_args(command + ["--hf-overrides", '{"index_topk": 4096}']).hf_overrides == {"index_topk": 4096}
    with pytest.raises(SystemExit):
        parser.parse_args(command + ["--hf-overrides", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_speculative_config_parses_as_a_json_object(command):
    parser = cli.build_parser()
    assert parser.parse_args(command).speculative_config is None
    given = parser.parse_args(command + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    assert given.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}


def test_generate_refuses_a_bad_speculative_config_in_one_line(capsys):
    assert cli.main(["generate", "--prompt", "hi", "--speculative-config", '{"method": "eagle"}']) == 2
    assert "speculative_config: method 'eagle'" in capsys.readouterr().err


def test_bench_names_what_it_has(capsys):
    assert cli.main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "'decode'" in err
    assert cli.main(["bench", "--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))


def test_every_benchmark_takes_its_arguments_from_the_command(capsys):
    """`dcp-jax bench NAME --help` reaches each script's own parser (a script that read sys.argv instead failed)."""
    for script in sorted((ROOT / "bench").glob("bench_*.py")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", script.stem.removeprefix("bench_"), "--help"])
        assert exit_info.value.code == 0, script.name
        assert "usage:" in capsys.readouterr().out, script.name


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


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_enable_tbo_parses_on_generate_and_serve(command):
    parser = cli.build_parser()
    assert parser.parse_args(command).enable_tbo is False
    assert parser.parse_args(command + ["--enable-tbo"]).enable_tbo is True


def test_a_vllm_launch_line_parses_as_vllm_reads_it():
    """`serve MODEL` with vLLM's flags: the positional model, --block-size, -tp/-dcp, several served names, the
    flags accepted for its launch lines (--trust-remote-code, --disable-log-requests), --generation-config."""
    args = cli.parse_args(["serve", "some/checkpoint", "-tp", "2", "-dcp", "2", "--block-size", "16",
                           "--kv-cache-dtype", "fp8", "--served-model-name", "a", "b", "--trust-remote-code",
                           "--disable-log-requests", "--generation-config", "vllm", "--max-logprobs", "5",
                           "--tokenizer", "some/tokenizer", "--chat-template", "t.jinja"])
    assert (args.model, args.tp, args.dcp, args.page_size, args.kv_cache_dtype) == ("some/checkpoint", 2, 2, 16, "fp8")
    assert args.served_model_name == ["a", "b"] and args.trust_remote_code and args.disable_log_requests
    assert (args.generation_config, args.max_logprobs, args.tokenizer) == ("vllm", 5, "some/tokenizer")
    assert cli.parse_args(["serve", "--model", "tiny"]).model == "tiny"
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "tiny", "--model", "glm-5"])  # two models


def test_flags_a_command_does_not_take_are_one_line_with_the_nearest(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "tiny", "--enforce-eager", "--pipeline-parallel-size", "2", "--block_size", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--enforce-eager" in err
    assert "--pipeline-parallel-size (nearest supported: --tensor-parallel-size)" in err
    assert "--block_size (nearest supported: --block-size)" in err


def test_serve_help_shows_the_defaults():
    help_text = cli._subparser(cli.build_parser(), "serve").format_help()
    for default in ("(default: 64)", "(default: 8000)", "(default: on)", "(default: auto)", "(default: 20)"):
        assert default in " ".join(help_text.split()), default
