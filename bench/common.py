"""What the benchmarks share: the run's provenance, a compile counter, HLO op counts; and, for the kernel benches
(bench_indexer, bench_topk, bench_sparse_mla and the small scripts beside them), DeepSeek-V3.2's shapes, a log,
timing loops, the same-run copy and matmul ceilings, kernel times from a profiler trace, the backend that tuning
knobs need, JSON files and plot plumbing.

Every benchmark records `run_info()` with its results (date, device, commit, jax), so a number in docs/ can be
traced to the run that measured it.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from bench.gpu_trace import Event, trace_events
from dcp_jax.config import DEEPSEEK_V32
from dcp_jax.runtime.xla_flags import step_compiler_options
from pallas_kernels import _indexer_mosaic, _indexer_triton, _sparse_mla_mosaic, _sparse_mla_triton, _topk_triton

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HLO_INT_ARITHMETIC = ("add", "subtract", "multiply", "divide", "remainder", "clamp", "maximum", "minimum", "select")


def commit() -> str:
    """The checkout's short commit, '+dirty' when the tree has changes; 'unknown' outside a git checkout."""
    with contextlib.suppress(Exception):
        head = subprocess.run(["git", "-C", _REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", _REPO, "status", "--porcelain"], capture_output=True, text=True).stdout
        return head + ("+dirty" if dirty.strip() else "")
    return "unknown"


def sizes(text: str) -> tuple[int, ...]:
    """A command line's sizes: '1,8,4K' -> (1, 8, 4096); 'M' and 'G' are 2**20 and 2**30."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        scale = units.get(part[-1], 1)
        out.append(int(part[:-1] if scale > 1 else part) * scale)
    return tuple(out)


def run_info() -> dict:
    """Date, commit, backend, device kind and count, jax version, XLA flags and the step programs' compiler
    options (`xla_flags`) of this run. Starts the backend."""
    dev = jax.devices()[0]
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
                backend=jax.default_backend(), device=dev.device_kind, num_devices=len(jax.devices()),
                jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                step_compiler_options=step_compiler_options())


class CompileCounter:
    """Counts XLA backend compiles while active (jax's monitoring event, fired on every compile)."""

    def __init__(self):
        self.count = 0

    def _listener(self, event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    @contextlib.contextmanager
    def active(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self._listener)


def hlo_op_counts(hlo_text: str) -> Counter:
    """Opcode -> count of the instructions of an optimized HLO module's text; integer arithmetic (an integer
    result type) is also counted under 'int:<opcode>'."""
    counts: Counter = Counter()
    for match in re.finditer(r"=\s+([a-z][a-z0-9]*)\[[^\]]*\]\S*\s+([a-z][\w-]*)\(", hlo_text):
        dtype, opcode = match.groups()
        counts[opcode] += 1
        if dtype[0] in "su" and opcode in _HLO_INT_ARITHMETIC:
            counts["int:" + opcode] += 1
    return counts


# ---- named shapes ------------------------------------------------------------------------------------------------

# DeepSeek-V3.2's decode shapes (`dcp_jax.config.DEEPSEEK_V32`), the ones the kernel benches time.
INDEX_HEADS = DEEPSEEK_V32.indexer.heads  # Hi = 64 lightning-indexer heads
INDEX_HEAD_DIM = DEEPSEEK_V32.indexer.head_dim  # Di = 128
TOP_K = DEEPSEEK_V32.indexer.topk  # k = 2048 tokens attended per row
LATENT_DIM = DEEPSEEK_V32.kv_lora_rank  # C = 512: the latent, sparse MLA's value width
ROPE_DIM = DEEPSEEK_V32.qk_rope_head_dim  # E = 64: the roped key after the latent
PAGE_SIZE = 64  # tokens per page: what the Mosaic indexer needs, FlashMLA's page
BATCHES = (1, 8, 32, 64)  # decode rows B of the benches' tables
CONTEXT_LENGTHS = (4096, 16384, 65536, 131072)  # tokens per row L of the benches' tables: 4K ... 128K
L2_BYTES = 60 << 20  # an H200's L2 cache


# ---- log, files, plots -------------------------------------------------------------------------------------------


class Log:
    """A bench's log: each call prints one line at once (its arguments joined by spaces, as `print` does) and keeps
    it; after `write_to(path)` every line also goes to that file. `elapsed()`: seconds since the log was made (made
    at a script's import: the run's time so far)."""

    def __init__(self):
        self.lines: list[str] = []
        self.path: str | None = None
        self._start = time.perf_counter()

    def __call__(self, *parts) -> None:
        line = " ".join(str(part) for part in parts)
        print(line, flush=True)
        self.lines.append(line)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def write_to(self, path: str, *, append: bool = False) -> None:
        """Writes the lines so far to `path` and appends each later line; the file starts empty unless `append`
        (then it keeps what earlier runs into the same folder wrote)."""
        with open(path, "a" if append else "w") as f:
            f.writelines(line + "\n" for line in self.lines)
        self.path = path

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


def default_out_dir() -> str:
    """Where a bench writes its logs and JSON: $OUT (the folder a device run brings back) or ./out."""
    return os.environ.get("OUT", "out")


def write_json(path: str, data) -> None:
    """`data` as JSON (indent 1) at `path`; values JSON cannot hold (a dtype, a tuple key) are written as str."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def read_json(path: str):
    """The data of a JSON file (a saved bench report, for `--plot`)."""
    with open(path) as f:
        return json.load(f)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use: only `--plot` needs
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def set_x_ticks(ax, values, labels) -> None:
    """x ticks at exactly `values`, named `labels` (no minor ticks: a log axis would add its own), light grid."""
    ax.set_xticks(values, labels)
    ax.minorticks_off()
    ax.grid(alpha=0.3)


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Lays the figure out tightly, writes it to `path` (PNG) and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# ---- timing --------------------------------------------------------------------------------------------------------


def median_seconds(fn, arg_sets: list[tuple], runs: int, *, warmup: int = 1, before_each: Callable | None = None,
                   sync: Callable | None = jax.block_until_ready) -> float:
    """Median wall seconds of `fn(*arg_sets[i % len(arg_sets)])` over i < runs, each timed call ended by
    `sync(result)` (None: a host function, nothing to wait for) and preceded, untimed, by `before_each()` when
    given (e.g. `flush_l2`); first `warmup` untimed calls on arg_sets[0] (compiles, caches)."""
    for _ in range(warmup):
        result = fn(*arg_sets[0])
        if sync is not None:
            sync(result)
    samples = []
    for i in range(runs):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        result = fn(*arg_sets[i % len(arg_sets)])
        if sync is not None:
            sync(result)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def throughput_seconds(fn, arg_groups: list[tuple], *, min_seconds: float = 0.05, reps: int = 5) -> float:
    """Median over `reps` of (wall time / calls) for back-to-back calls rotating over `arg_groups`, enough calls
    to last `min_seconds` (one sync per rep: the device time of a call, not its dispatch)."""
    for args in arg_groups:
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_groups[0]))
    once = time.perf_counter() - start
    calls = max(len(arg_groups), math.ceil(min_seconds / max(once, 1e-6)))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(calls):
            result = fn(*arg_groups[i % len(arg_groups)])
        jax.block_until_ready(result)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


_l2_flush_buffer = None


@jax.jit
def _plus_one(x):
    return x + 1


def flush_l2() -> None:
    """Evicts the GPU's L2 (60 MB on an H200): one pass of x + 1 over a 256 MB int32 buffer, kept between calls."""
    global _l2_flush_buffer
    if _l2_flush_buffer is None:
        _l2_flush_buffer = jnp.zeros((64 << 20,), jnp.int32)  # 64M int32 = 256 MB > 60 MB L2
    _l2_flush_buffer = jax.block_until_ready(_plus_one(_l2_flush_buffer))


def warm_up_clocks(seconds: float = 1.0) -> None:
    """Runs f32 4096^3 matmuls for `seconds` so the GPU leaves its idle clock before timing (an idle H200 reads
    345 MHz; one copy ceiling measured 3.48 TB/s without this)."""
    busy = jnp.ones((4096, 4096), jnp.float32)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        busy = jax.block_until_ready(busy @ busy * (1 / 4096))


def copy_tbps(nbytes: int, seconds: Callable[[Callable, list[tuple]], float]) -> float:
    """Same-run copy ceiling in TB/s: the bytes read and written by x -> x + 1 over an int32 array of `nbytes`,
    over the seconds per call that `seconds(fn, arg_sets)` (the bench's own timing loop) measures."""
    big = jnp.zeros((nbytes // 4,), jnp.int32)
    return 2 * big.nbytes / seconds(_plus_one, [(big,)]) / 1e12


@jax.jit
def _bf16_matmul(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.bfloat16)


def matmul_tflops(seconds: Callable[[Callable, list[tuple]], float], n: int = 8192) -> float:
    """Same-run bf16 matmul ceiling in TFLOP/s: 2 n^3 FLOPs of an [n, n] x [n, n] product of normal values (bf16
    out), over the seconds per call that `seconds(fn, arg_sets)` measures on (a, b) and (b, a)."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.bfloat16)
    b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
    return 2 * n**3 / seconds(_bf16_matmul, [(a, b), (b, a)]) / 1e12


# ---- kernel times from a profiler trace ----------------------------------------------------------------------------


def device_seconds(fn, arg_sets: list[tuple], calls: int) -> float:
    """Seconds of one call of fn rotating over arg_sets: on a GPU its kernels' summed durations over `calls` traced
    calls (each set run once first: compiles, warms), elsewhere `throughput_seconds` (wall time)."""
    if jax.default_backend() != "gpu":
        return throughput_seconds(fn, arg_sets, min_seconds=0.0, reps=1)
    for arg_set in arg_sets:
        jax.block_until_ready(fn(*arg_set))
    rotation = itertools.cycle(arg_sets)
    lines = traced_device_events(lambda: fn(*next(rotation)), (), calls)
    return sum(map(sum, kernel_durations_us(lines, line_prefix="Stream").values())) / calls / 1e6


def traced_device_events(fn, args: tuple, calls: int, plane_prefix: str = "/device:GPU") -> dict[str, list[Event]]:
    """{line name: events} (`gpu_trace.trace_events`) of the planes named from `plane_prefix` in a profiler
    trace around `calls` calls of fn(*args), each waited for; the trace's temporary folder is removed."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        return trace_events(trace_dir, plane_prefix)


def kernel_durations_us(lines: dict[str, list[Event]], *, line_prefix: str = "",
                        name_chars: int | None = None) -> dict[str, list[float]]:
    """Kernel name -> the durations (us) of its events, in line order, over the trace lines whose name starts
    with `line_prefix` ("Stream": the GPU's stream lines); names cut to `name_chars` characters when given (long
    fusion names that differ only at the end then count as one)."""
    durations: dict[str, list[float]] = {}
    for line_name, events in lines.items():
        if line_name.startswith(line_prefix):
            for event in events:
                durations.setdefault(event.name[:name_chars], []).append(event.duration_ns / 1e3)
    return durations


# ---- backends of tuning knobs ------------------------------------------------------------------------------------

# op -> backend -> the implementation whose keyword-only arguments are that backend's tuning knobs, in the order
# the "pallas" backend tries them.
KNOBS_OF = {
    "indexer_logits": {"mosaic": _indexer_mosaic.indexer_logits, "triton": _indexer_triton.indexer_logits},
    "topk": {"triton": _topk_triton.topk},
    "sparse_mla_decode": {"mosaic": _sparse_mla_mosaic.sparse_mla_decode,
                          "triton": _sparse_mla_triton.sparse_mla_decode},
}


def keyword_only_arguments(fn) -> set[str]:
    """The names of fn's keyword-only parameters (an implementation's tuning knobs, with its contract options)."""
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


def knobs_with_backend(op: str, knobs: dict, *args) -> dict:
    """`knobs` for `pallas_kernels.<op>(*args, **knobs)` with the backend that tuning knobs need (the ops refuse
    knobs under the default "pallas"): the knobs as they are when they name a "backend" or are empty (the
    default runs); else with the first implementation of `KNOBS_OF[op]` that has every knob and runs these
    arguments, as "pallas" would pick it (the first that has them all when none runs them: the op then says
    why). ValueError when no implementation has them all."""
    if not knobs or "backend" in knobs:
        return dict(knobs)
    has_all = [name for name, fn in KNOBS_OF[op].items() if set(knobs) <= keyword_only_arguments(fn)]
    if not has_all:
        raise ValueError(f"no {op} implementation has every knob of {sorted(knobs)}: "
                         + "; ".join(f"{name}: {sorted(keyword_only_arguments(fn))}"
                                     for name, fn in KNOBS_OF[op].items()))
    runs = [name for name in has_all if not pallas_kernels.unsupported(op, name, *args)]
    return dict(knobs, backend=(runs or has_all)[0])
