"""Results of the sharded decode benchmark (`dcp_jax/decode_bench.py`): stage names, the stage breakdown, the
target checks, markdown tables and plots, from the rows the benchmark writes (JSON lines)."""

from __future__ import annotations

import os
from collections.abc import Callable

# Cumulative prefixes of one layer's work, in data-flow order (DESIGN.md). "base" runs no attention at all
# (embeddings, the final norm and lm_head, dispatch and the metadata transfer); "merge" is the whole attention
# layer without the MLP; the full step (`host`) adds the MLP.
STAGES = ("base", "projections", "indexer", "topk", "exchange", "sparse_mla", "merge")
# Names of the breakdown columns: stage i's time is t(through_i) - t(through_{i-1}); "other" is t(base) and
# "mlp" is t(host) - t(through_merge).
BREAKDOWN = ("other",) + STAGES[1:] + ("mlp",)

def _index(rows: list[dict], kind: str, *fields) -> dict:
    return {tuple(r[f] for f in fields): r for r in rows if r.get("kind") == kind}


def breakdown(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(dcp, kernels, batch, context) -> stage -> ms (differences of consecutive staged medians)."""
    points = _index(rows, "point", "dcp", "kernels", "batch", "context", "variant")
    out = {}
    for (w, k, b, c, v) in points:
        if v != "through_base":
            continue
        chain = ["through_" + s for s in STAGES] + ["host"]
        if not all((w, k, b, c, name) in points for name in chain):
            continue
        ms = [points[(w, k, b, c, name)]["median_ms"] for name in chain]
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
    lines = ["| kernels | dcp | B | L | step ms (p10-p90) | tok/s | fallback ms (vs host) | KV/rank MiB | "
             "index-K/rank MiB | max L at B | compile s | recompiles |", "|" + "---|" * 12]
    for (w, k, b, c, v), p in points.items():
        if v != "host":
            continue
        prog = programs.get((w, k, b, "host"), {})
        fb = points.get((w, k, b, c, "fallback"))
        fb_text = f"{fb['median_ms']:.3f} ({100 * (fb['median_ms'] / p['median_ms'] - 1):+.1f}%)" if fb else "-"
        max_l = _tokens(prog["max_context"]) if "max_context" in prog else "-"
        lines.append(f"| {k} | {w} | {b} | {c} | {p['median_ms']:.3f} ({p['p10_ms']:.3f}-{p['p90_ms']:.3f}) | "
                     f"{p['tokens_per_s']:.0f} | {fb_text} | {_mib(p['kv_latent_bytes_per_rank'])} | "
                     f"{_mib(p['kv_index_bytes_per_rank'])} | {max_l} | {prog.get('compile_s', 0):.1f} | "
                     f"{p['recompiles']} |")
    parts = ["\n".join(lines)]
    stages = breakdown(rows)
    if stages:
        lines = ["| kernels | dcp | B | L | " + " | ".join(BREAKDOWN) + " | step |",
                 "|" + "---|" * (len(BREAKDOWN) + 5)]
        for (w, k, b, c), ms in stages.items():
            lines.append(f"| {k} | {w} | {b} | {c} | " + " | ".join(f"{ms[s]:.3f}" for s in BREAKDOWN)
                         + f" | {points[(w, k, b, c, 'host')]['median_ms']:.3f} |")
        parts.append("Stage breakdown, ms (differences of staged-variant medians; see the method):\n"
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
            line = sorted((r["context"], r["median_ms"]) for r in points
                          if (r["dcp"], r["kernels"], r["batch"]) == (w, k, b))
            ax.plot(*zip(*line), marker="o", linestyle="-" if k == "pallas" else "--", label=f"DCP {w} {k}")
        contexts = sorted({r["context"] for r in points})
        ax.set(xscale="log", xlabel="context length", ylabel="step ms (median)", title=f"B = {b}", ylim=(0, None))
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
    """Plots, the markdown tables and the target checks of `rows` (one run, or several merged with
    --report); returns the exit code: 1 when a target is not met."""
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
    echo("targets: zero length-derived ops in every host-length program, zero recompiles in every timed loop: "
         + ("MET" if not bad else f"NOT MET ({len(bad)})"))
    for line in bad:
        echo("  " + line)
    return 1 if bad else 0
