"""Retrieval accuracy of a model through the OpenAI server with lm-eval (issue 26): the task's prompts at each
context written as local lm-eval tasks (no hub), a server started per configuration (DCP size, interleave, cache
formats, or dense attention: index_topk raised past the context by --hf-overrides), lm-eval's `local-completions`
and `local-chat-completions --apply_chat_template` run against it; or, with client `llm` (for a machine without
lm-eval or the server's packages, such as the GPU machines here), the offline API `LLM` in this process. Writes
results.json (accuracy and every answer per configuration, context and client), results.md (the table and whether
the answers are identical across configurations) and accuracy.png under --out.

  python scripts/eval_retrieval.py --model dsa-tiny --out /tmp/eval \\
      --configs dcp=1 dcp=2 dcp=2,interleave=2 dcp=1,index_cache=fp8,latent_cache=fp8 dense

A configuration is `dense` or comma-separated key=value of: dcp, interleave, index_cache, latent_cache, dtype.
`--base-url http://HOST:PORT` evaluates a server already running there instead (any engine, any model).
On a CPU the server (or LLM) runs on simulated devices (one per DCP rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path.insert(0, REPO)

# num_pages: the KV pool's pages (default: what the device's memory holds, as the engine sizes it).
CONFIG_KEYS = {"dcp": int, "interleave": int, "index_cache": str, "latent_cache": str, "dtype": str, "num_pages": int}
# lm-eval's two clients against the server, and the offline API in this process (for a machine without lm-eval or
# the server's packages).
CLIENTS = ("completions", "chat", "llm")
SERVER_CLIENTS = ("completions", "chat")
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: [";"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def parse_config(text: str) -> dict:
    """`dense` or key=value,... (CONFIG_KEYS) -> the server's settings, with a `name`."""
    if text == "dense":
        return {"name": "dense", "dense": True}
    config = {"name": text}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in CONFIG_KEYS or not value:
            raise argparse.ArgumentTypeError(f"a configuration is 'dense' or key=value,... of {sorted(CONFIG_KEYS)}, "
                                             f"got {text!r}")
        config[key] = CONFIG_KEYS[key](value)
    return config


def write_tasks(directory: str, contexts: list[int], examples: int, seed: int) -> list[str]:
    """One lm-eval task per context (`dsa_retrieval_<context>`: its prompts, `evaluate.examples_for`, in a JSON
    lines file beside its YAML); returns the task names."""
    from dcp_jax.train.evaluate import examples_for

    os.makedirs(directory, exist_ok=True)
    names = []
    for context in contexts:
        name = f"dsa_retrieval_{context}"
        data = os.path.join(directory, f"{name}.jsonl")
        with open(data, "w") as f:
            for prompt, answer in examples_for(context, examples, seed):
                f.write(json.dumps({"prompt": prompt, "target": answer.rstrip(";")}) + "\n")
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            f.write(TASK_YAML.format(name=name, data=data))
        names.append(name)
    return names


class Server:
    """`dcp-jax serve` for one configuration, in a subprocess on loopback; stopped by SIGINT (it drains)."""

    MODEL = "model"  # the served model's name

    def __init__(self, model: str, config: dict, *, max_model_len: int, max_num_seqs: int, port: int, log: str):
        dcp = config.get("dcp", 1)
        cmd = [sys.executable, "-m", "dcp_jax.cli", "serve", "--model", model, "--served-model-name", self.MODEL,
               "--dcp", str(dcp), "--interleave", str(config.get("interleave", 1)), "--port", str(port),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
               "--index-cache", config.get("index_cache", "exact"),
               "--latent-cache", config.get("latent_cache", "exact"), "--dtype", config.get("dtype", "auto"),
               "--no-prompt-logprobs", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
        if config.get("dense"):
            cmd += ["--hf-overrides", json.dumps({"index_topk": max_model_len})]
        if "num_pages" in config:
            cmd += ["--num-pages", str(config["num_pages"])]
        self.url, self.log_path = f"http://127.0.0.1:{port}", log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        while self.proc.poll() is None:  # its log says when it is ready
            with open(log) as f:
                if "ready:" in f.read():
                    return
            time.sleep(1)
        raise RuntimeError(f"the server of {config['name']} exited before it was ready (log: {log})")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_lm_eval(url: str, served_model: str, client: str, tasks: list[str], task_dir: str, out: str,
                concurrency: int) -> dict:
    """lm-eval through `client` on the tasks against the server at `url` serving `served_model`: {task: [the
    answer of each example, in order]}."""
    if client == "completions":
        model, args = "local-completions", (f"model={served_model},base_url={url}/v1/completions,"
                                            "tokenizer_backend=None,tokenized_requests=False")
        extra = []
    else:
        model, args = "local-chat-completions", f"model={served_model},base_url={url}/v1/chat/completions"
        extra = ["--apply_chat_template"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model,
           "--model_args", f"{args},num_concurrent={concurrency},max_retries=1,timeout=3600",
           "--tasks", ",".join(tasks), "--include_path", task_dir, "--output_path", out, "--log_samples", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"lm-eval {client} failed: {proc.stderr[-3000:]}")
    answers = {}
    for task in tasks:
        path = max((os.path.join(root, f) for root, _, files in os.walk(out) for f in files
                    if f.startswith(f"samples_{task}_")), key=os.path.getmtime)
        with open(path) as f:
            samples = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
        answers[task] = [s["filtered_resps"][0] if isinstance(s["filtered_resps"], list) else s["filtered_resps"]
                         for s in samples]
    return answers


def served_model(url: str) -> str:
    """The model id the server at `url` serves (the first of GET /v1/models)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        return json.load(reply)["data"][0]["id"]


def read_task(task_dir: str, task: str, field: str) -> list[str]:
    """One field (prompt or target) of each of a task's examples, in order."""
    with open(os.path.join(task_dir, f"{task}.jsonl")) as f:
        return [json.loads(line)[field] for line in f]


def run_llm(model: str, config: dict, tasks: list[str], task_dir: str, *, max_model_len: int,
            max_num_seqs: int, num_speculative_tokens: int = 0) -> tuple[dict, dict, int]:
    """The offline API (`LLM.generate`, greedy, lm-eval's generation: up to 8 tokens, stopped at ';') on the tasks'
    prompts with the configuration's settings, in this process: ({task: [the answer of each example, in order]},
    {task: the MTP drafts' acceptance (kept / drafted, from the engine's metrics)} when `num_speculative_tokens`
    drafts a step, else {}, the KV pool's pages)."""
    import gc

    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.serving.llm import LLM
    from dcp_jax.serving.metrics import PREFIX

    speculative = ({"method": "mtp", "num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens
                   else None)
    llm = LLM(model, dcp=config.get("dcp", 1), interleave=config.get("interleave", 1),
              index_cache=config.get("index_cache", "exact"), latent_cache=config.get("latent_cache", "exact"),
              dtype=config.get("dtype", "auto"), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              hf_overrides={"index_topk": max_model_len} if config.get("dense") else None,
              speculative_config=speculative, num_pages=config.get("num_pages"))
    num_pages = llm.engine_config.num_pages
    params = SamplingParams(max_tokens=8, temperature=0, stop=[";"])

    metrics = llm.core.metrics

    def drafted_and_kept():
        return [metrics.value(f"{PREFIX}_spec_decode_num_{kind}_total") for kind in ("draft_tokens", "accepted_tokens")]

    answers, acceptance = {}, {}
    for task in tasks:
        before = drafted_and_kept() if speculative else None
        outputs = llm.generate(prompts=read_task(task_dir, task, "prompt"), sampling_params=params)
        answers[task] = [out.outputs[0].text for out in outputs]
        if speculative:
            drafted, kept = (after - earlier for after, earlier in zip(drafted_and_kept(), before))
            acceptance[task] = kept / drafted if drafted else None  # None: no step drafted
    del llm
    gc.collect()  # the next configuration's pool takes the device memory this one held
    return answers, acceptance, num_pages


def summarize(results: dict, contexts: list[int]) -> str:
    """The markdown table (accuracy % per configuration, client and context) and the answers' agreement."""
    lines = ["| configuration | client | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
             "|---|---|" + "---|" * len(contexts)]
    for name, per_client in results["configs"].items():
        for client, per_context in per_client.items():
            lines.append(f"| {name} | {client} | " + " | ".join(
                f"{100 * per_context[str(c)]['accuracy']:.1f}" for c in contexts) + " |")
            if "mtp_acceptance" in per_context[str(contexts[0])]:
                kept = [per_context[str(c)]["mtp_acceptance"] for c in contexts]
                lines.append(f"| {name} | {client}: MTP drafts kept % | " + " | ".join(
                    "-" if k is None else f"{100 * k:.1f}" for k in kept) + " |")
    sparse = [name for name in results["configs"] if name != "dense"]
    if len(sparse) > 1:
        for client in results["configs"][sparse[0]]:
            differing = {c: [n for n in sparse if client in results["configs"][n] and
                             results["configs"][n][client][str(c)]["answers"] !=
                             results["configs"][sparse[0]][client][str(c)]["answers"]] for c in contexts}
            lines.append(f"\n{client}: answers identical across {', '.join(sparse)}: "
                         + ("yes" if not any(differing.values()) else f"no, differing from {sparse[0]}: {differing}"))
    return "\n".join(lines) + "\n"


def plot(results: dict, contexts: list[int], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, per_client in results["configs"].items():
        for client, per_context in per_client.items():
            ax.plot(contexts, [100 * per_context[str(c)]["accuracy"] for c in contexts], marker="o",
                    label=f"{name} ({client})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("retrieval accuracy %")
    ax.set_ylim(-2, 102)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="an HF checkpoint directory, a shipped checkpoint (dsa-tiny) or a preset (with "
                             "--base-url: the name the results carry)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1, help="the prompts' seed (training draws from seed 0)")
    parser.add_argument("--configs", nargs="+", type=parse_config, default=[parse_config("dcp=1")])
    parser.add_argument("--clients", default=",".join(SERVER_CLIENTS), help=f"comma-separated, of {CLIENTS}")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--port", type=int, default=None, help="default: a free one")
    parser.add_argument("--base-url", default=None,
                        help="evaluate the server already running at this URL (http://HOST:PORT) instead of "
                             "starting one per configuration (--configs is then ignored)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="client llm: draft this many tokens a step with the model's MTP layer and record the "
                             "drafts' acceptance (greedy: the answers are the same as without)")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    clients = args.clients.split(",")
    if set(clients) - set(CLIENTS):
        parser.error(f"--clients: choose from {CLIENTS}")
    if args.base_url and set(clients) - set(SERVER_CLIENTS):
        parser.error(f"--base-url: the clients of a running server are {SERVER_CLIENTS}")
    if args.num_speculative_tokens and clients != ["llm"]:
        parser.error("--num-speculative-tokens: the acceptance is read from the in-process engine (--clients llm)")

    if "llm" in clients:  # simulated CPU devices for the largest DCP size, asked for before jax starts
        from dcp_jax.serving.loading import use_cpu_devices

        use_cpu_devices(max(config.get("dcp", 1) for config in args.configs))
    from dcp_jax.config import model_directory, preset
    from dcp_jax.model.architecture import config_from_hf

    os.makedirs(args.out, exist_ok=True)
    task_dir = os.path.join(args.out, "tasks")
    tasks = write_tasks(task_dir, contexts, args.examples, args.seed)
    # A prompt of `context` leaves room for the chat template and the generation (`evaluate.EVAL_ROOM`).
    max_model_len = max(contexts)
    directory = model_directory(args.model)
    cfg = None if args.base_url else config_from_hf(directory) if directory else preset(args.model)
    if cfg is not None and max_model_len > cfg.max_position_embeddings:
        parser.error(f"--contexts: {max_model_len} tokens exceed the model's {cfg.max_position_embeddings}")
    results = {"model": args.model, "examples": args.examples, "seed": args.seed, "configs": {},
               "llm_num_pages": {}}  # client llm: each configuration's KV pool
    configs = [{"name": "server"}] if args.base_url else args.configs
    for config in configs:
        started, answers, acceptance = time.perf_counter(), {}, {}
        if args.base_url:
            url = args.base_url.rstrip("/")
            served = served_model(url)
            for client in clients:
                answers[client] = run_lm_eval(url, served, client, tasks, task_dir,
                                              os.path.join(args.out, "lm_eval", config["name"], client),
                                              args.max_num_seqs)
        elif set(clients) & set(SERVER_CLIENTS):
            server = Server(args.model, config, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                            port=args.port or _free_port(), log=os.path.join(args.out, f"server_{config['name']}.log"))
            try:
                for client in set(clients) & set(SERVER_CLIENTS):
                    answers[client] = run_lm_eval(server.url, Server.MODEL, client, tasks, task_dir,
                                                  os.path.join(args.out, "lm_eval", config["name"], client),
                                                  args.max_num_seqs)
            finally:
                server.stop()
        if "llm" in clients:
            answers["llm"], acceptance, results["llm_num_pages"][config["name"]] = run_llm(
                args.model, config, tasks, task_dir, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                num_speculative_tokens=args.num_speculative_tokens)
        per_client = {}
        for client in clients:
            per_client[client] = {}
            for context, task in zip(contexts, tasks):
                targets = read_task(task_dir, task, "target")
                right = sum(a.strip() == t for a, t in zip(answers[client][task], targets))
                per_client[client][str(context)] = {"accuracy": right / len(targets), "answers": answers[client][task]}
                if client == "llm" and acceptance:
                    per_client[client][str(context)]["mtp_acceptance"] = acceptance[task]
        results["configs"][config["name"]] = per_client
        print(f"{config['name']}: " + "; ".join(
            f"{client} " + ", ".join(f"{c}: {100 * per_client[client][str(c)]['accuracy']:.1f}%" for c in contexts)
            for client in clients) + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    table = summarize(results, contexts)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    plot(results, contexts, os.path.join(args.out, "accuracy.png"))
    print(table)
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
