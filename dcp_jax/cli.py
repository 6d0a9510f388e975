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

from dcp_jax.config import (DEFAULT_BUCKETS, DEFAULT_MAX_NUM_BATCHED_TOKENS, DTYPE_CHOICES, INDEX_CACHE_FORMATS,
                            INDEX_CACHE_HELP, KERNEL_CHOICES, LATENT_CACHE_FORMATS, LATENT_CACHE_HELP,
                            QUANTIZATION_CHOICES, WEIGHT_FORMATS)
from dcp_jax.runtime.multihost import Distributed
from dcp_jax.serving.loading import use_cpu_devices

DTYPE_HELP = "weights, activations and exact caches: auto (the checkpoint's; bfloat16 for presets)"
QUANTIZATION_HELP = ("auto: the checkpoint's (a block fp8 checkpoint's linear weights stay fp8); none: dequantize "
                     "them into --dtype; fp8: also quantize an unquantized checkpoint's or a preset's linear weights "
                     "to DeepSeek's block fp8 (128 x 128) on load")
BATCHED_TOKENS_HELP = "rows of one step at most: its decode rows and prefill-chunk tokens (long prompts run in chunks)"
PREFIX_CACHING_HELP = "reuse the KV pages of full virtual blocks a prompt shares with earlier requests"
UNROLL_LAYERS_HELP = ("compile one copy of every decoder layer instead of one scan over each stack of layers: start-up "
                      "grows with depth; the decode step was 15%% faster on the H200 (docs/performance.md)")
GPU_MEMORY_HELP = "share of each GPU's memory for weights, workspace and the KV pool (the pool takes the rest)"
EXPERT_PARALLEL_HELP = ("split the routed experts whole over the tp ranks, each running only the tokens routed to "
                        "its experts (default: every rank runs every expert on its slice of their width)")

H200_MEMORY_GIB = 143771 / 1024  # 143,771 MiB

# The benchmarks live beside the package in a source checkout: bench/bench_<name>.py, each with main(argv).
BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "bench"


# The shipped trained retrieval model (`dcp_jax/checkpoints/dsa-tiny`, docs/training.md).
DEFAULT_MODEL = "dsa-tiny"
MODEL_HELP = ("a shipped checkpoint (dsa-tiny: trained, the default), a preset of random weights (tiny, deepseek-v3.2, "
              "glm-5) or a HF directory")


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
    print(f"tiny model: {TINY.num_hidden_layers} sparse MLA layers, index_topk={TINY.index_topk}, "
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

    tp = args.tp or args.dcp
    use_cpu_devices(max(args.devices or tp, tp))
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                                seed=args.seed, stop=args.stop)
        llm = LLM(args.model, dcp=args.dcp, interleave=args.interleave, tp=tp, max_model_len=args.max_model_len,
                  page_size=args.page_size, kernels=args.kernels, max_num_seqs=max(len(args.prompt), 1),
                  num_layers=args.num_layers, index_cache=args.index_cache, latent_cache=args.latent_cache,
                  dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=args.enable_prefix_caching,
                  enable_expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
                  unroll_layers=args.unroll_layers, hf_overrides=args.hf_overrides,
                  speculative_config=args.speculative_config, enable_tbo=args.enable_tbo)
        outputs = llm.generate(args.prompt, params, use_tqdm=True)
    except ValueError as e:
        print(f"dcp-jax generate: {e}", file=sys.stderr)
        return 2
    print(f"model {args.model}: {llm.model_config.num_hidden_layers} layers {llm.dtype}, tp={tp}"
          f"{' (expert parallel)' if args.enable_expert_parallel else ''} dcp={args.dcp} "
          f"interleave={args.interleave}, {args.index_cache} index cache, {args.latent_cache} latent cache, "
          f"backend {llm.backend}")
    for out in outputs:
        done = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{done.text!r} ({len(done.token_ids)} tokens, {done.finish_reason})")
    return 0


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: the model name)")
    s.add_argument("--num-layers", type=int, default=None, help="use only the first N decoder layers")
    s.add_argument("--dcp", type=int, default=2, help="DCP size W")
    s.add_argument("--tp", type=int, default=None, help="TP ranks (default: dcp)")
    s.add_argument("--enable-expert-parallel", action="store_true", help=EXPERT_PARALLEL_HELP)
    s.add_argument("--interleave", type=int, default=1, help="interleave size S")
    s.add_argument("--devices", type=int, default=None, help="simulated CPU devices (default: tp)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--root-path", default="", help="FastAPI root_path behind a path-based proxy")
    s.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins, a JSON list")
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list")
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection (or one sending a request head) is kept open")
    s.add_argument("--limit-concurrency", type=int, default=None,
                   help="most connections and requests at once; past it a 503 (uvicorn's)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight may finish in before they are aborted "
                        "(0: abort at once)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings, capped by the pool)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests decoding at once (the widest decode step)")
    s.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help=BATCHED_TOKENS_HELP)
    s.add_argument("--buckets", type=_parse_sizes, default=list(DEFAULT_BUCKETS),
                   help="step widths compiled (rows), comma-separated; with max-num-seqs and the token budget")
    s.add_argument("--enable-prefix-caching", action="store_true", help=PREFIX_CACHING_HELP)
    s.add_argument("--page-size", type=int, default=8)
    s.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: what --gpu-memory-utilization leaves; CPU: max-num-seqs full requests)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=GPU_MEMORY_HELP)
    s.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    s.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto", help=QUANTIZATION_HELP)
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="dispatch each step before reading the previous one's tokens")
    s.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                   help="auto: the Pallas kernels on a GPU, the references elsewhere")
    s.add_argument("--unroll-layers", action="store_true", help=UNROLL_LAYERS_HELP)
    s.add_argument("--hf-overrides", type=_json_object, default=None, help=HF_OVERRIDES_HELP)
    s.add_argument("--speculative-config", type=_json_object, default=None, help=SPECULATIVE_HELP)
    s.add_argument("--enable-tbo", action="store_true", help=TBO_HELP)
    s.add_argument("--index-cache", choices=INDEX_CACHE_FORMATS, default="exact", help=INDEX_CACHE_HELP)
    s.add_argument("--latent-cache", choices=LATENT_CACHE_FORMATS, default="exact", help=LATENT_CACHE_HELP)
    s.add_argument("--seed", type=int, default=0, help="weights seed of a preset; default sampling seed")
    s.add_argument("--compilation-cache-dir", default=None, help="persistent XLA compilation cache")
    s.add_argument("--no-prompt-logprobs", action="store_true", help="skip the all-logits prefill programs")
    s.add_argument("--coordinator-address", default=None,
                   help="multi-host: HOST:PORT of process 0 (jax.distributed's coordinator; the step channel uses "
                        "PORT + 1); every process runs serve with the same arguments but --process-id")
    s.add_argument("--num-processes", type=int, default=1, help="multi-host: processes of the deployment")
    s.add_argument("--process-id", type=int, default=0,
                   help="multi-host: this process (0 serves HTTP and schedules; the others run its steps)")


HF_OVERRIDES_HELP = "config.json fields to replace, a JSON object (e.g. '{\"index_topk\": 16384}')"
TBO_HELP = ("two-batch overlap: each layer's attention runs as two micro-batches of the step's rows, one's "
            "collectives beside the other's compute")
SPECULATIVE_HELP = ("speculative decoding with the model's MTP layer, a JSON object: "
                    "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}' (1 to 3 drafts; steps then run "
                    "synchronously)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def load_engine(args: argparse.Namespace, tp: int, distributed):
    """serve's Engine (one process's of a multi-host `distributed` deployment, or None)."""
    processes = 1 if distributed is None else distributed.num_processes
    use_cpu_devices(max(args.devices or tp, tp) // processes)
    import jax

    from dcp_jax.serving.engine import Engine

    jax.config.update("jax_default_matmul_precision", "highest")
    return Engine(args.model, dcp=args.dcp, interleave=args.interleave, tp=tp, page_size=args.page_size,
                  num_pages=args.num_pages, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  bucket_ladder=tuple(args.buckets), max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=args.enable_prefix_caching, kernels=args.kernels, seed=args.seed,
                  num_layers=args.num_layers, index_cache=args.index_cache, latent_cache=args.latent_cache,
                  dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                  async_scheduling=args.async_scheduling, prompt_logprobs=not args.no_prompt_logprobs,
                  compilation_cache_dir=args.compilation_cache_dir,
                  enable_expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
                  unroll_layers=args.unroll_layers, hf_overrides=args.hf_overrides,
                  speculative_config=args.speculative_config, enable_tbo=args.enable_tbo,
                  coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                  process_id=args.process_id)


def _follow(args: argparse.Namespace, engine) -> int:
    """A multi-host process after process 0: run its steps until it stops (0) or is gone (1)."""
    from dcp_jax.runtime.multihost import PeerLost

    print(f"dcp-jax serve: process {args.process_id} of {args.num_processes} ready, following process 0",
          flush=True)
    try:
        engine.follow()
    except PeerLost as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr)
        return 1
    print(f"dcp-jax serve: process 0 stopped; process {args.process_id} exits", flush=True)
    return 0


def serve(args: argparse.Namespace) -> int:
    """Bind first (a bad address is one line and exit 2 before any loading), load and compile while /health
    answers 503, serve; SIGTERM or SIGINT drain and exit 0."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # jax logs every platform it probes and lacks ("Unable to initialize backend 'tpu'") at INFO.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from dcp_jax.serving.openai_api import CorsOptions
    from dcp_jax.serving.server import OpenAIServer

    tp = args.tp or args.dcp
    try:
        distributed = Distributed.of(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr)
        return 2
    if distributed is not None and not distributed.is_leader:
        try:
            engine = load_engine(args, tp, distributed)
        except ValueError as e:
            print(f"dcp-jax serve: {e}", file=sys.stderr)
            return 2
        return _follow(args, engine)
    try:
        server = OpenAIServer(host=args.host, port=args.port, api_key=args.api_key,
                              served_model_name=args.served_model_name, root_path=args.root_path,
                              cors=CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                               args.allow_credentials),
                              timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                              shutdown_timeout=args.shutdown_timeout, uvicorn_log_level=args.uvicorn_log_level,
                              access_log=not args.disable_uvicorn_access_log)
    except ValueError as e:
        print(f"dcp-jax serve: {e}", file=sys.stderr)
        return 2
    print(f"dcp-jax serve: listening on {server.url} (loading {args.model}: /health answers 503 until ready)",
          flush=True)

    def load():
        return load_engine(args, tp, distributed)

    def ready(engine):
        config = engine.engine_config
        print(f"dcp-jax serve: ready: model {server.serving.model_name} ({engine.model_config.num_hidden_layers} "
              f"layers {engine.dtype}), tp={tp}{' (expert parallel)' if args.enable_expert_parallel else ''} "
              f"dcp={args.dcp} interleave={args.interleave}, max_model_len "
              f"{config.max_model_len}, buckets {config.buckets}, {engine.num_pages} KV pages ({args.index_cache} "
              f"index cache, {args.latent_cache} latent cache), backend {engine.backend}", flush=True)

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
    """Run bench/bench_<name>.py of the source checkout with the remaining arguments."""
    script = BENCH_DIR / f"bench_{args.name}.py"
    if not script.is_file():
        have = sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))
        where = f"it has {have}" if have else f"{BENCH_DIR} is not there (bench/ comes with the source checkout)"
        print(f"dcp-jax bench: no benchmark {args.name!r}: {where}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(BENCH_DIR.parent))
    return runpy.run_path(str(script), run_name="dcp_jax_bench")["main"](args.args)


def plan(args: argparse.Namespace) -> int:
    """Print the memory plan (`model/memory_plan.py`) of a preset or a checkpoint's config on a mesh."""
    from dcp_jax.config import (PRESETS, ModelConfig, ParallelConfig, model_directory, num_speculative_tokens, preset,
                                resolve_dtype, unknown_model)
    from dcp_jax.model.memory_plan import format_plan, make_plan
    from dcp_jax.model.weights import fp8_block_size

    directory = model_directory(args.model)
    if directory is None and args.model not in PRESETS:
        print(f"dcp-jax plan: {unknown_model(args.model)}", file=sys.stderr)
        return 2
    try:
        cfg = ModelConfig.from_hf(directory) if directory else preset(args.model)
        weight_format = args.weight_format
        if weight_format == "auto":
            weight_format = "fp8" if directory and fp8_block_size(directory) else "model_dtype"
        parallel = ParallelConfig(tp=args.dcp if args.tp is None else args.tp, dcp=args.dcp,
                                  enable_expert_parallel=args.enable_expert_parallel)
        result = make_plan(cfg, parallel, dtype=resolve_dtype(args.dtype, cfg), weight_format=weight_format,
                           device_bytes=int(args.device_memory_gib * 2**30),
                           gpu_memory_utilization=args.gpu_memory_utilization, page_size=args.page_size,
                           max_num_seqs=args.max_num_seqs, mtp=num_speculative_tokens(args.speculative_config) > 0)
    except ValueError as e:
        print(f"dcp-jax plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(result, os.path.basename(os.path.normpath(args.model))))
    return 0


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
    g.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--num-layers", type=int, default=None, help="use only the first N decoder layers")
    g.add_argument("--dcp", type=int, default=1, help="DCP size W")
    g.add_argument("--tp", type=int, default=None, help="TP ranks (default: dcp)")
    g.add_argument("--enable-expert-parallel", action="store_true", help=EXPERT_PARALLEL_HELP)
    g.add_argument("--interleave", type=int, default=1, help="interleave size S")
    g.add_argument("--devices", type=int, default=None, help="simulated CPU devices (default: tp)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help=BATCHED_TOKENS_HELP)
    g.add_argument("--enable-prefix-caching", action="store_true", help=PREFIX_CACHING_HELP)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    g.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto", help=QUANTIZATION_HELP)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=GPU_MEMORY_HELP)
    g.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto")
    g.add_argument("--unroll-layers", action="store_true", help=UNROLL_LAYERS_HELP)
    g.add_argument("--hf-overrides", type=_json_object, default=None, help=HF_OVERRIDES_HELP)
    g.add_argument("--speculative-config", type=_json_object, default=None, help=SPECULATIVE_HELP)
    g.add_argument("--enable-tbo", action="store_true", help=TBO_HELP)
    g.add_argument("--index-cache", choices=INDEX_CACHE_FORMATS, default="exact", help=INDEX_CACHE_HELP)
    g.add_argument("--latent-cache", choices=LATENT_CACHE_FORMATS, default="exact", help=LATENT_CACHE_HELP)
    g.set_defaults(run=generate)
    s = commands.add_parser("serve", help="OpenAI-compatible server (default: the shipped dsa-tiny model)")
    add_serve_arguments(s)
    s.set_defaults(run=serve)
    m = commands.add_parser("plan", help="memory plan: weight bytes per rank, KV bytes per token, tokens that fit")
    m.add_argument("--model", default="deepseek-v3.2", help="preset name or HF directory (its config.json)")
    m.add_argument("--dcp", type=int, default=1, help="DCP size W")
    m.add_argument("--tp", type=int, default=None, help="TP ranks (default: dcp)")
    m.add_argument("--enable-expert-parallel", action="store_true", help=EXPERT_PARALLEL_HELP)
    m.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    m.add_argument("--weight-format", choices=("auto",) + WEIGHT_FORMATS, default="auto",
                   help="auto: the checkpoint's (fp8 for a block-fp8 checkpoint; the model dtype for presets); fp8 "
                        "also plans a load under --quantization fp8")
    m.add_argument("--device-memory-gib", type=float, default=H200_MEMORY_GIB,
                   help="memory of one device (default: an H200's, as nvidia-smi reports it)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=GPU_MEMORY_HELP)
    m.add_argument("--page-size", type=int, default=64)
    m.add_argument("--max-num-seqs", type=int, default=256)
    m.add_argument("--speculative-config", type=_json_object, default=None,
                   help="as serve's: drafting with the MTP layer adds its weights and its layer of KV")
    m.set_defaults(run=plan)
    b = commands.add_parser("bench", help="a benchmark of bench/ (source checkout): dcp-jax bench decode --help",
                            add_help=False)
    b.add_argument("name", help="decode: the sharded decode step over DCP sizes x contexts x batches")
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(run=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
