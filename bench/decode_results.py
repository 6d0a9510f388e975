"""Results of the sharded decode benchmark (`bench_decode.py`): stage names, the stage breakdown, the
target checks, markdown tables and plots, from the rows the benchmark writes (JSON lines)."""

from __future__ import annotations

import os
from collections.abc import Callable

from bench import step_profile

# Cumulative prefixes of one layer's attention, in data-flow order (DESIGN.md); the rest of each layer (its MLP or
# MoE) runs whole in every variant. "base" runs no attention at all (embeddings, the MLPs, the final norm, lm_head,
# sampling, dispatch and the metadata transfer); through "merge" is the whole step (`host`), so the staged variants
# are `through_` + each stage but the last.
STAGES = ("base", "projections", "indexer", "topk", "exchange", "sparse_mla", "merge")
# Names of the breakdown columns: stage i's time is t(through_i) - t(through_{i-1}), with through_merge = host;
# "rest" is t(base).
BREAKDOWN = ("rest",) + STAGES[1:]

def _index(rows: list[dict], kind: str, *fields) -> dict:
    return {tuple(r[f] for f in fields): r for r in rows if r.get("kind") == kind}


def step_ms(point: dict) -> float:
    """The device's step time: the program alone, back to back on placed inputs (`bench_decode.time_steps`)."""
    return point["device_ms"]


def breakdown(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(dcp, kernels, batch, context) -> stage -> ms (differences of consecutive staged variants' device step
    times, so the host-side work of a step, the same in every variant, does not blur them)."""
    points = _index(rows, "point", "dcp", "kernels", "batch", "context", "variant")
    out = {}
    for (w, k, b, c, v) in points:
        if v != "through_base":
            continue
        chain = ["through_" + s for s in STAGES[:-1]] + ["host"]
        if not all((w, k, b, c, name) in points for name in chain):
            continue
        ms = [step_ms(points[(w, k, b, c, name)]) for name in chain]
        out[(w, k, b, c)] = dict(zip(BREAKDOWN, [ms[0]] + [ms[i] - ms[i - 1] for i in range(1, len(ms))]))
    return out


def failures(rows: list[dict]) -> list[str]:
    """The targets the benchmark asserts: zero length derivations in every host-length program, zero recompiles in
    every timed loop, and every configured program compiled and timed."""
    bad = []
    for r in rows:
        where = f"dcp={r.get('dcp')} {r.get('kernels')} B={r.get('batch')} {r.get('variant')}"
        if r["kind"] == "program" and r["variant"] == "host" and r["length_derivations"]:
            bad.append(f"{where}: {r['length_derivations']} integer ops derived from global lengths")
        if r["kind"] == "point" and r["recompiles"]:
            bad.append(f"{where} L={r['context']}: {r['recompiles']} compiles during the timed steps")
        if r["kind"] == "error":
            bad.append(f"{where} L={r.get('context', '-')}: {r['stage']} failed: {r['error'][:300]}")
    return bad


def _mib(n) -> str:
    return f"{n / 2**20:.1f}"


def _context_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n / 1e3:.1f}K" if n >= 10**3 else str(n)


def markdown(rows: list[dict]) -> str:
    """The three tables of docs/perf_decode.md: latency, stage breakdown, host vs fallback programs."""
    programs = _index(rows, "program", "dcp", "kernels", "batch", "variant")
    points = _index(rows, "point", "dcp", "kernels", "batch", "context", "variant")
    lines = ["| kernels | dcp | B | L | latency ms (p10-p90) | pipelined ms | device ms | tok/s (device) | "
             "fallback device ms (vs host) | KV/rank MiB | index-K/rank MiB | max L at B | compile s | recompiles |",
             "|" + "---|" * 14]
    for (w, k, b, c, v), p in points.items():
        if v != "host":
            continue
        prog = programs.get((w, k, b, "host"), {})
        fb = points.get((w, k, b, c, "fallback"))
        fb_text = f"{step_ms(fb):.3f} ({100 * (step_ms(fb) / step_ms(p) - 1):+.1f}%)" if fb else "-"
        max_l = _tokens(prog["max_context"]) if "max_context" in prog else "-"
        lines.append(f"| {k} | {w} | {b} | {c} | {p['median_ms']:.3f} ({p['p10_ms']:.3f}-{p['p90_ms']:.3f}) | "
                     f"{p['pipelined_ms']:.3f} | {step_ms(p):.3f} | {b / step_ms(p) * 1e3:.0f} | {fb_text} | "
                     f"{_mib(p['kv_latent_bytes_per_rank'])} | "
                     f"{_mib(p['kv_index_bytes_per_rank'])} | {max_l} | {prog.get('compile_s', 0):.1f} | "
                     f"{p['recompiles']} |")
    parts = ["\n".join(lines)]
    stages = breakdown(rows)
    if stages:
        lines = ["| kernels | dcp | B | L | " + " | ".join(BREAKDOWN) + " | step |",
                 "|" + "---|" * (len(BREAKDOWN) + 5)]
        for (w, k, b, c), ms in stages.items():
            lines.append(f"| {k} | {w} | {b} | {c} | " + " | ".join(f"{ms[s]:.3f}" for s in BREAKDOWN)
                         + f" | {step_ms(points[(w, k, b, c, 'host')]):.3f} |")
        parts.append("Stage breakdown, ms (differences of staged variants' device step times; see the method):\n"
                     + "\n".join(lines))
    lines = ["| kernels | dcp | B | length-derived int ops host / fallback | HLO ops host / fallback | "
             "HLO int arithmetic host / fallback | compile s host / fallback |", "|" + "---|" * 7]
    for (w, k, b, v), host in programs.items():
        fb = programs.get((w, k, b, "fallback"))
        if v != "host" or not fb or "hlo_ops" not in fb:
            continue
        ops = ", ".join(f"{name} {n}" for name, n in fb["length_derivation_ops"])
        lines.append(f"| {k} | {w} | {b} | {host['length_derivations']} / {fb['length_derivations']} ({ops}) | "
                     f"{host['hlo_ops']} / {fb['hlo_ops']} | {host['hlo_int_arith_ops']} / {fb['hlo_int_arith_ops']} | "
                     f"{host['compile_s']:.1f} / {fb['compile_s']:.1f} |")
    if len(lines) > 2:
        parts.append("Host-supplied vs device-derived local lengths (compiled programs):\n" + "\n".join(lines))
    return "\n\n".join(parts)


def dcp_scaling(rows: list[dict]) -> tuple[str, list[str]]:
    """DCP size W against the smallest W measured, per kernels x B x L (host steps): per-rank KV bytes, maximum
    context and step-time ratios, as a markdown table; and the issue's target check at L >= 64K, B >= 32 (per-rank
    KV <= half, maximum context >= 1.9x, device step no slower), one line per W."""
    points = _index(rows, "point", "dcp", "kernels", "batch", "context", "variant")
    programs = _index(rows, "program", "dcp", "kernels", "batch", "variant")
    sizes = sorted({w for (w, *_rest) in points})
    if len(sizes) < 2:
        return "", []
    base_w = sizes[0]
    lines = [f"| kernels | W | B | L | KV/rank vs W={base_w} | max L vs W={base_w} | device step ms W={base_w} -> W "
             f"| ratio | latency ms W={base_w} -> W |", "|" + "---|" * 9]
    verdicts = []
    for w in sizes[1:]:
        ok, checked = True, 0
        for (pw, k, b, c, v), p in sorted(points.items()):
            base = points.get((base_w, k, b, c, v))
            if pw != w or v != "host" or base is None:
                continue
            kv = p["kv_latent_bytes_per_rank"] / base["kv_latent_bytes_per_rank"]
            prog, base_prog = programs.get((w, k, b, "host"), {}), programs.get((base_w, k, b, "host"), {})
            cap = (prog["max_context"] / base_prog["max_context"]
                   if "max_context" in prog and base_prog.get("max_context") else float("nan"))
            ratio = step_ms(p) / step_ms(base)
            lines.append(f"| {k} | {w} | {b} | {_context_label(c)} | {kv:.2f} | {cap:.2f} | "
                         f"{step_ms(base):.3f} -> {step_ms(p):.3f} | {ratio:.2f} | "
                         f"{base['median_ms']:.3f} -> {p['median_ms']:.3f} |")
            if k == "pallas" and c >= 65536 and b >= 32:
                checked += 1
                ok &= kv <= 1 / (w // base_w) + 1e-9 and cap >= 0.95 * (w // base_w) and ratio <= 1.0
        if checked:
            verdicts.append(f"DCP={w} vs DCP={base_w} (pallas, L >= 64K, B >= 32, {checked} points): per-rank KV "
                            f"<= 1/{w // base_w}, max context >= {0.95 * (w // base_w):.2f}x, step no slower: "
                            + ("MET" if ok else "NOT MET"))
    return "\n".join(lines), verdicts


def plot(rows: list[dict], img_dir: str) -> list[str]:
    """Latency vs context per DCP size (one panel per batch) and capacity vs DCP size, as PNGs in `img_dir`.
    Returns the paths written; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in rows if r["kind"] == "point" and r["variant"] == "host"]
    programs = [r for r in rows if r["kind"] == "program" and r["variant"] == "host" and "max_total_tokens" in r]
    if not points:
        return []
    os.makedirs(img_dir, exist_ok=True)
    batches = sorted({r["batch"] for r in points})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for (w, k) in sorted({(r["dcp"], r["kernels"]) for r in points}):
            line = sorted((r["context"], step_ms(r)) for r in points
                          if (r["dcp"], r["kernels"], r["batch"]) == (w, k, b))
            ax.plot(*zip(*line), marker="o", linestyle="-" if k == "pallas" else "--", label=f"DCP {w} {k}")
        contexts = sorted({r["context"] for r in points})
        ax.set(xscale="log", xlabel="context length", ylabel="device step ms", title=f"B = {b}", ylim=(0, None))
        ax.set_xticks(contexts, [_context_label(c) for c in contexts])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths = [os.path.join(img_dir, "decode_latency_vs_context.png")]
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if programs:
        fig, ax = plt.subplots(figsize=(5, 3.8))
        for k in sorted({r["kernels"] for r in programs}):
            best = {}
            for r in programs:
                if r["kernels"] == k:
                    best[r["dcp"]] = max(best.get(r["dcp"], 0), r["max_total_tokens"])
            sizes = sorted(best)
            ax.plot(sizes, [best[w] for w in sizes], marker="o", label=k)
            ax.plot(sizes, [best[sizes[0]] * w / sizes[0] for w in sizes], linestyle=":", color="gray",
                    label=f"{k}: ideal (W x DCP {sizes[0]})")
        ax.set(xlabel="DCP size W", ylabel="KV tokens that fit (all rows)", title="capacity vs DCP size")
        ax.set_xticks(sorted({r["dcp"] for r in programs}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(img_dir, "decode_capacity_vs_dcp.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


# ---- command line ----------------------------------------------------------------------------------------------


def report(rows: list[dict], *, img_dir: str, echo: Callable[[str], None]) -> int:
    """The step-efficiency table (`step_profile.report`), plots, the markdown tables and the target checks of
    `rows` (one run, or several merged with --report); returns the exit code: 1 when a target is not met, 2 for
    runs of different index- or latent-cache formats (their rows share keys, so one would hide the other)."""
    efficiency = step_profile.report(rows)
    if efficiency:  # its rows name their own formats, so it merges runs of any formats
        echo(efficiency)
    formats = {(r.get("index_cache", "exact"), r.get("latent_cache", "exact"))
               for r in rows if r["kind"] in ("point", "program")}
    if len(formats) > 1:
        echo(f"error: these rows mix (index, latent) cache formats {sorted(formats)}; report each format separately")
        return 2
    for info in (r for r in rows if r["kind"] == "run"):
        echo(f"run {info['date']}: {info['num_devices']} x {info['device']}, commit {info['commit']}, "
             f"jax {info['jax']}")
    if img_dir != "none":
        try:
            for path in plot(rows, img_dir):
                echo(f"plot: {path}")
        except ImportError:
            echo("plots skipped: matplotlib is not installed (pip install matplotlib)")
    skipped = sum(r["kind"] == "skipped" for r in rows)
    if skipped:
        echo(f"{skipped} points skipped by --budget-s")
    bad = failures(rows)
    echo(markdown(rows))
    scaling, verdicts = dcp_scaling(rows)
    if scaling:
        echo("\nDCP scaling (host steps):\n" + scaling)
    for line in verdicts:
        echo(line)
    echo("targets: zero length-derived ops in every host-length program, zero recompiles in every timed loop: "
         + ("MET" if not bad else f"NOT MET ({len(bad)})"))
    for line in bad:
        echo("  " + line)
    return 1 if bad else 0
