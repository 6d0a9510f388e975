"""The `dcp-jax` command: demo, generate, serve, plan (the memory plan) and the benchmarks of the source checkout
(`bench`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import runpy
import sys

from dcp_jax.config import KERNEL_CHOICES, WEIGHT_FORMATS
from dcp_jax.runtime.multihost import Distributed
from dcp_jax.serving.engine_args import DEFAULT_MODEL, EngineArgs
from dcp_jax.serving.loading import use_cpu_devices

H200_MEMORY_GIB = 143771 / 1024  # 143,771 MiB

# The benchmarks live beside the package in a source checkout: bench/bench_<name>.py, each with main(argv).
BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "bench"


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return sizes


def demo(args: argparse.Namespace) -> int:
    use_cpu_devices(args.devices)
    import jax
    from tqdm import tqdm

    from dcp_jax.config import TINY, EngineConfig, ParallelConfig
    from dcp_jax.demo import run_comparison, staggered_schedule

    jax.config.update("jax_default_matmul_precision", "highest")
    if max(args.dcp) > len(jax.devices()):
        print(f"dcp-jax demo: dcp={max(args.dcp)} needs that many devices, have {len(jax.devices())}", file=sys.stderr)
        return 2
    engine = EngineConfig(page_size=4, num_pages=128, max_num_seqs=args.max_seqs, max_model_len=args.steps + 8,
                          max_num_batched_tokens=args.max_seqs)  # decode rows only
    schedule = staggered_schedule(args.max_seqs, args.steps, args.seed)
    print(f"tiny model: {TINY.num_hidden_layers} sparse MLA layers, index_topk={TINY.indexer.topk}, "
          f"{args.steps} decode steps, buckets {engine.buckets}, backend {jax.default_backend()}")
    reports = []
    for dcp in tqdm(args.dcp, desc="dcp sizes", disable=not sys.stderr.isatty()):
        parallel = ParallelConfig(tp=dcp, dcp=dcp, interleave=args.interleave)
        reports.append(run_comparison(TINY, parallel, engine, schedule, seed=args.seed, kernels=args.kernels))
    print(f"{'dcp':>4} {'tp':>4} {'interleave':>10} {'buckets':>8} {'max ctx':>8} {'step ms':>8} {'max |err|':>10}")
    for r in reports:
        print(f"{r.dcp:>4} {r.tp:>4} {r.interleave:>10} {r.buckets_compiled:>8} {r.max_context:>8} "
              f"{r.step_ms:>8.2f} {r.max_abs_err:>10.2e}")
    worst = max(r.max_abs_err for r in reports)
    ok = worst < 1e-4
    print("sharded == single-device:", "yes" if ok else f"NO (max error {worst:.3e})")
    return 0 if ok else 1


def generate(args: argparse.Namespace) -> int:
    from dcp_jax.serving.llm import LLM
    from dcp_jax.host.sampling import SamplingParams

    try:
        engine_args = EngineArgs.from_cli_args(args)
    except ValueError as e:
        print(f"dcp-jax generate: {e}", file=sys.stderr)
        return 2
    tp = engine_args.tensor_parallel_size
    use_cpu_devices(max(args.devices or tp, tp))
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                                seed=args.sampling_seed, stop=args.stop)
        llm = LLM(**vars(engine_args))
        outputs = llm.generate(args.prompt, params, use_tqdm=True)
    except ValueError as e:
        print(f"dcp-jax generate: {e}", file=sys.stderr)
        return 2
    parallel, config = llm.parallel_config, llm.engine_config
    print(f"model {engine_args.model}: {llm.model_config.num_hidden_layers} layers {llm.dtype}, tp={parallel.tp}"
          f"{' (expert parallel)' if parallel.enable_expert_parallel else ''} dcp={parallel.dcp} "
          f"interleave={parallel.interleave}, {config.index_cache} index cache, {config.latent_cache} latent cache, "
          f"backend {llm.backend}")
    for out in outputs:
        done = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{done.text!r} ({len(done.token_ids)} tokens, {done.finish_reason})")
    return 0


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """serve's options: every engine argument (`EngineArgs`), the server's and the simulated devices."""
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `vllm serve MODEL` (the same as --model)")
    EngineArgs.add_cli_args(s)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model ids clients use: replies carry the first, requests may name any (default: the model "
                        "name)")
    s.add_argument("--devices", type=int, default=None, help="simulated CPU devices (default: tp)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback)")
    s.add_argument("--port", type=int, default=8000, help="port; 0: any free port (default: 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--root-path", default="", help="FastAPI root_path behind a path-based proxy")
    s.add_argument("--allowed-origins", type=_json_list, default=[],
                   help="CORS origins, a JSON list (default: none, so no web page of another origin reads replies)")
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list "
                                                                              "(default: [\"*\"])")
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list "
                                                                              "(default: [\"*\"])")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's launch lines: the engine logs no request's contents")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="(default: info)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection (or one sending a request head) is kept open (default: 5)")
    s.add_argument("--limit-concurrency", type=int, default=None,
                   help="most connections and requests at once; past it a 503 (uvicorn's)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight may finish in before they are aborted "
                        "(0: abort at once; default: 10)")
    s.add_argument("--no-prompt-logprobs", action="store_true", help="skip the all-logits prefill programs")
    s.add_argument("--chat-template", default=None,
                   help="a jinja chat template, or a file holding one (default: the checkpoint's chat_template.jinja "
                        "or tokenizer_config.json's chat_template, else the project's plain template)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat_template (rendered in jinja's sandbox)")


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def load_engine(args: argparse.Namespace, distributed):
    """serve's Engine (one process's of a multi-host `distributed` deployment, or None)."""
    engine_args = EngineArgs.from_cli_args(args)
    tp = engine_args.tensor_parallel_size
    processes = 1 if distributed is None else distributed.num_processes
    use_cpu_devices(max(args.devices or tp, tp) // processes)
    import jax

    from dcp_jax.serving.engine import Engine

    jax.config.update("jax_default_matmul_precision", "highest")
    return Engine(**vars(engine_args), prompt_logprobs=not args.no_prompt_logprobs)


def _follow(args: argparse.Namespace, engine) -> int:
    """A multi-host process after process 0: run its steps until it stops (0) or is gone (exit 1 at once, with the
    error: the exit handlers' jax.distributed shutdown would wait on the dead coordinator and abort)."""
    from dcp_jax.runtime.multihost import PeerLost

    print(f"dcp-jax serve: process {args.process_id} of {args.num_processes} ready, following process 0",
          flush=True)
    try:
        engine.follow()
    except PeerLost as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    print(f"dcp-jax serve: process 0 stopped; process {args.process_id} exits", flush=True)
    return 0


def serve(args: argparse.Namespace) -> int:
    """Bind first (a bad address is one line and exit 2 before any loading), load and compile while /health
    answers 503, serve; SIGTERM or SIGINT drain and exit 0."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # jax logs every platform it probes and lacks ("Unable to initialize backend 'tpu'") at INFO.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from dcp_jax.serving.chat_template import chat_template_option
    from dcp_jax.serving.openai_api import CorsOptions
    from dcp_jax.serving.server import OpenAIServer

    try:
        distributed = Distributed.of(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr)
        return 2
    if distributed is not None and not distributed.is_leader:
        try:
            engine = load_engine(args, distributed)
        except ValueError as e:
            print(f"dcp-jax serve: {e}", file=sys.stderr)
            return 2
        return _follow(args, engine)
    try:
        chat_template = None if args.chat_template is None else chat_template_option(args.chat_template)
        server = OpenAIServer(host=args.host, port=args.port, api_key=args.api_key,
                              served_model_name=args.served_model_name, root_path=args.root_path,
                              cors=CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                               args.allow_credentials),
                              timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                              shutdown_timeout=args.shutdown_timeout, uvicorn_log_level=args.uvicorn_log_level,
                              access_log=not args.disable_uvicorn_access_log, chat_template=chat_template,
                              trust_request_chat_template=args.trust_request_chat_template)
    except ValueError as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr)
        return 2
    print(f"dcp-jax serve: listening on {server.url} (loading {args.model}: /health answers 503 until ready)",
          flush=True)

    def load():
        return load_engine(args, distributed)

    def ready(engine):
        config, parallel = engine.engine_config, engine.parallel_config
        expert_parallel = " (expert parallel)" if parallel.enable_expert_parallel else ""
        print(f"dcp-jax serve: ready: model {server.serving.model_name} ({engine.model_config.num_hidden_layers} "
              f"layers {engine.dtype}), tp={parallel.tp}{expert_parallel} dcp={parallel.dcp} interleave="
              f"{parallel.interleave}, max_model_len {config.max_model_len}, buckets {config.buckets}, "
              f"{engine.num_pages} KV pages ({config.index_cache} index cache, {config.latent_cache} latent cache), "
              f"backend {engine.backend}", flush=True)

    try:
        server.serve_forever(load, ready)
    except ValueError as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr)
        return 2
    if server.is_loading:  # stopped while compiling: nothing to drain, and the worker cannot be interrupted
        logging.shutdown()
        os._exit(0)
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run bench/bench_<name>.py of the source checkout with the remaining arguments; without a name (or with
    --help) list them."""
    if args.name is None or args.list_benchmarks:
        scripts = sorted(BENCH_DIR.glob("bench_*.py"))
        if not scripts:
            print(f"dcp-jax bench: {BENCH_DIR} is not there (bench/ comes with the source checkout)", file=sys.stderr)
            return 2
        print("usage: dcp-jax bench NAME [its options; dcp-jax bench NAME --help]\n\nbenchmarks:")
        for script in scripts:
            print(f"  {script.stem.removeprefix('bench_'):16} {_first_line(script)}")
        return 0
    script = BENCH_DIR / f"bench_{args.name}.py"
    if not script.is_file():
        have = sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))
        where = f"it has {have}" if have else f"{BENCH_DIR} is not there (bench/ comes with the source checkout)"
        print(f"dcp-jax bench: no benchmark {args.name!r}: {where}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(BENCH_DIR.parent))
    return runpy.run_path(str(script), run_name="dcp_jax_bench")["main"](args.args)


def _first_line(script) -> str:
    """The first line of a script's module docstring."""
    import ast

    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def plan(args: argparse.Namespace) -> int:
    """Print the memory plan (`model/memory_plan.py`) of a preset or a checkpoint's config on a mesh."""
    from dcp_jax.config import PRESETS, ParallelConfig, model_directory, num_speculative_tokens, preset, resolve_dtype
    from dcp_jax.config import unknown_model
    from dcp_jax.model.architecture import config_from_hf
    from dcp_jax.model.memory_plan import format_plan, make_plan
    from dcp_jax.model.weights import checkpoint_weight_format

    directory = model_directory(args.model)
    if directory is None and args.model not in PRESETS:
        print(f"dcp-jax plan: {unknown_model(args.model)}", file=sys.stderr)
        return 2
    try:
        engine_args = EngineArgs.from_cli_args(args)
        cfg = config_from_hf(directory) if directory else preset(args.model)
        weight_format = args.weight_format
        if weight_format == "auto":
            weight_format = checkpoint_weight_format(directory, cfg) if directory else "model_dtype"
            if engine_args.quantization == "fp8" and weight_format == "model_dtype":
                weight_format = "fp8"  # quantized to block fp8 on load
        parallel = ParallelConfig(tp=engine_args.tensor_parallel_size, dcp=engine_args.dcp,
                                  enable_expert_parallel=engine_args.enable_expert_parallel)
        result = make_plan(cfg, parallel, dtype=resolve_dtype(engine_args.dtype, cfg), weight_format=weight_format,
                           device_bytes=int(args.device_memory_gib * 2**30),
                           gpu_memory_utilization=engine_args.gpu_memory_utilization,
                           page_size=engine_args.page_size, max_num_seqs=engine_args.max_num_seqs,
                           mtp=num_speculative_tokens(engine_args.speculative_config) > 0,
                           channel_fp8=engine_args.quantization == "ptpc_fp8")
    except ValueError as e:
        print(f"dcp-jax plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(result, os.path.basename(os.path.normpath(args.model))))
    return 0


# The engine arguments a plan reads, and its model's default: a plan sizes a real model, not the shipped tiny one.
PLAN_ARGUMENTS = ("model", "tp", "dcp", "enable_expert_parallel", "dtype", "quantization", "page_size",
                  "max_num_seqs", "gpu_memory_utilization", "speculative_config")
PLAN_DEFAULTS = {"model": "deepseek-v3.2"}


def build_parser() -> argparse.ArgumentParser:
    """The `dcp-jax` parser: every command, each with its `run` function as a default."""
    parser = argparse.ArgumentParser(prog="dcp-jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="run the sharded sparse-attention stack on simulated devices and check it")
    p.add_argument("--dcp", type=_parse_sizes, default=[1, 2, 4, 8], help="DCP sizes, comma-separated")
    p.add_argument("--interleave", type=int, default=1, help="interleave size S")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--steps", type=int, default=40, help="decode steps")
    p.add_argument("--max-seqs", type=int, default=4, help="concurrent requests (largest bucket)")
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=demo)
    g = commands.add_parser("generate", help="generate text with the shipped dsa-tiny, a preset (random weights) or a "
                                             "HF checkpoint")
    EngineArgs.add_cli_args(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--devices", type=int, default=None, help="simulated CPU devices (default: tp)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="the requests' seed (default: drawn from --seed)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.set_defaults(run=generate)
    s = commands.add_parser("serve", help="OpenAI-compatible server (default: the shipped dsa-tiny model)")
    add_serve_arguments(s)
    s.set_defaults(run=serve)
    m = commands.add_parser("plan", help="memory plan: weight bytes per rank, KV bytes per token, tokens that fit")
    EngineArgs.add_cli_args(m, only=PLAN_ARGUMENTS, defaults=PLAN_DEFAULTS)
    m.add_argument("--weight-format", choices=("auto",) + WEIGHT_FORMATS, default="auto",
                   help="auto: the checkpoint's (fp8 for a block-fp8 checkpoint, mxfp4 for an AMD Quark MXFP4 one: "
                        "its routed experts in MXFP4, the rest in --dtype; the model dtype for presets, fp8 under "
                        "--quantization fp8); --quantization ptpc_fp8 puts the linear layers but the experts in "
                        "per-channel fp8 on top of it")
    m.add_argument("--device-memory-gib", type=float, default=H200_MEMORY_GIB,
                   help="memory of one device (default: an H200's, as nvidia-smi reports it)")
    m.set_defaults(run=plan)
    b = commands.add_parser("bench", help="a benchmark of bench/ (source checkout): dcp-jax bench decode --help",
                            add_help=False)
    b.add_argument("-h", "--help", action="store_true", dest="list_benchmarks", help="list the benchmarks")
    b.add_argument("name", nargs="?", default=None, help="a benchmark (dcp-jax bench --help lists them)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(run=bench)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments: `serve MODEL` as `--model MODEL` (vLLM's form); flags a command does not take
    end it with one line naming each and the nearest it takes (exit status 2)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sys.exit(_refuse_unknown(parser, args.command, unknown))
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None:
        if args.model not in (model_tag, DEFAULT_MODEL):
            parser.error(f"the model is given twice: {model_tag!r} and --model {args.model!r}")
        args.model = model_tag
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a bad command line exits with status 2 (argparse's)
    if getattr(args, "trust_remote_code", False):
        print("dcp-jax: --trust-remote-code has no effect: no checkpoint code runs here (the architectures are "
              "built in)", file=sys.stderr)
    return args.run(args)


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> int:
    """One line for the flags this command does not take, each with the nearest one it does; exit status 2."""
    import difflib

    known = [flag for action in _subparser(parser, command)._actions for flag in action.option_strings]
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")] or unknown
    parts = []
    for flag in flags:
        nearest = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        parts.append(f"{flag} (nearest supported: {nearest[0]})" if nearest else flag)
    print(f"dcp-jax {command}: not supported here: {', '.join(parts)}; see dcp-jax {command} --help",
          file=sys.stderr)
    return 2


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


if __name__ == "__main__":
    sys.exit(main())
