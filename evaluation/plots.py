"""Plots of the trade-off the project exists for, with matplotlib (files only, the Agg backend).

* `plot_tradeoff`: from the result matrix (`evaluation.matrix.build_tables`): task accuracy against the KV bytes
  held and against the effective bits, one point per (cache mode, method, bit width), the cache-only rows as the
  16-bit reference and full recompute as a line. ``matrix`` writes it as ``accuracy_vs_kv.png`` beside
  ``matrix.md`` and, with ``--card``, into the model card.
* `plot_serve_load`: from ``benchmarks/serve_load.py --json``: throughput and latency against concurrent clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

#: The file `plot_tradeoff` writes beside ``matrix.md`` (and into a model card).
TRADEOFF_PNG = "accuracy_vs_kv.png"
#: The methods' colours, by their place among the registered quantizers (KIVI, KVQuant, dLLM-KVQ, then plug-ins).
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan")
MODE_MARKERS = {"prefix": "o", "dual": "s"}


def tradeoff_points(tables: Mapping[str, Any], model: str | None = None) -> list[dict[str, Any]]:
    """The points of `plot_tradeoff`: one per quantized row and one per cache-only row of ``model`` (the first
    model when None), each ``{"mode", "method", "bits", "accuracy", "kib", "bits_nominal", "bits_storage"}``.

    ``kib``: KiB of reused K/V held at the peak of the row's largest request; for a cache-only row the same K/V
    in bf16 (what its quantized rows report as ``bf16_bytes``; None for a matrix written before that was kept).
    ``bits_*``: measured effective bits per element, mean of K and V (16 for cache-only rows).
    """
    blocks = [b for b in tables["blocks"] if model is None or b["model"] == model]
    model = blocks[0]["model"] if blocks else model
    points, seen, bf16 = [], set(), {}
    for block in (b for b in blocks if b["model"] == model):
        for row in block["rows"]:
            kv = row["kv"]
            if row["method"] == "none" or not kv or row["average"] is None:
                continue
            key = (row["cache_mode"], row["method"], row["bits"], row["sides"], row.get("rule"))
            if key in seen or row["sides"] != "kv" or row.get("rule"):
                continue
            seen.add(key)
            if kv.get("bf16_bytes"):
                bf16[row["cache_mode"]] = kv["bf16_bytes"]
            points.append({"mode": row["cache_mode"], "method": row["method"], "bits": row["bits"],
                           "accuracy": row["average"], "kib": kv["bytes_held"] / 1024,
                           "bits_nominal": (kv["k_nominal_bits"] + kv["v_nominal_bits"]) / 2,
                           "bits_storage": (kv["k_storage_bits"] + kv["v_storage_bits"]) / 2})
    for block in blocks[:1]:  # the cache-only rows are the same in every bit width's block
        for row in block["rows"]:
            if row["method"] == "none" and row["cache_mode"] != "none" and row["average"] is not None:
                held = bf16.get(row["cache_mode"])
                points.append({"mode": row["cache_mode"], "method": "none", "bits": 16, "accuracy": row["average"],
                               "kib": None if held is None else held / 1024, "bits_nominal": 16.0,
                               "bits_storage": 16.0})
    return points


def method_styles() -> dict[str, tuple[str, str]]:
    """Each registered quantization method's colour and label (`service.quant.registry`: its ``label``), in
    registration order; a method of a matrix that is not registered now is drawn grey under its name."""
    from service.quant.registry import method, methods

    quantized = [name for name in methods() if method(name).quantizer is not None]
    return {name: (PALETTE[i % len(PALETTE)], method(name).title) for i, name in enumerate(quantized)}


def plot_tradeoff(tables: Mapping[str, Any], path: Path, model: str | None = None) -> Path | None:
    """Accuracy (%) against KV KiB held (top) and against effective bits (nominal, measured; bottom), one column
    per cache mode, one point per (method, bit width) of ``model``: colour the method, marker the bit width; points
    with the same width and score (ties) share one label. The cache-only rows (K/V in bf16) are black stars, full
    recompute a dotted line. Returns None (and writes nothing) when the matrix has no quantized row."""
    from matplotlib.ticker import FixedLocator, ScalarFormatter

    points = tradeoff_points(tables, model)
    styles = method_styles()

    def style(name: str) -> tuple[str, str]:
        return styles.get(name, ("tab:gray", name))

    modes = [m for m in MODE_MARKERS if any(p["mode"] == m and p["method"] != "none" for p in points)]
    if not modes:
        return None
    reference = next((r["average"] for b in tables["blocks"] for r in b["rows"]
                      if r["cache_mode"] == "none" and r["average"] is not None), None)
    widths = sorted({p["bits"] for p in points if p["method"] != "none"}, reverse=True)
    markers = dict(zip(widths, "osD^v"))
    axis_labels = (("kib", "KV held at the peak request (KiB, log scale)"),
                   ("bits_nominal", "effective bits per K/V element (nominal, measured; mean of K and V)"))
    fig, axes = plt.subplots(2, len(modes), figsize=(6.2 * len(modes), 8.2), sharey=True, squeeze=False)
    for col, mode in enumerate(modes):
        here = [p for p in points if p["mode"] == mode]
        for row, (x, label) in enumerate(axis_labels):
            ax = axes[row][col]
            groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
            for p in here:
                if p[x] is None:
                    continue
                if p["method"] == "none":
                    ax.scatter(p[x], p["accuracy"], marker="*", s=220, color="black", zorder=3)
                    ax.annotate("cache only (K/V in bf16)", (p[x], p["accuracy"]), textcoords="offset points",
                                xytext=(0, -16), ha="right", fontsize=8)
                    continue
                ax.scatter(p[x], p["accuracy"], marker=markers[p["bits"]], s=75, alpha=0.9, zorder=3,
                           color=style(p["method"])[0], edgecolor="black", linewidth=0.6)
                groups.setdefault((p["bits"], round(p["accuracy"], 2)), []).append(p)
            for (bits, accuracy), members in groups.items():
                names = ", ".join(style(m["method"])[1]
                                  for m in sorted(members, key=lambda m: m[x]))
                ax.annotate(f"{names} ({bits}-bit)", (max(m[x] for m in members), accuracy),
                            textcoords="offset points", xytext=(9, -3), fontsize=8)
            if reference is not None:
                ax.axhline(reference, color="grey", linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            if x == "bits_nominal":
                ax.xaxis.set_major_locator(FixedLocator([2, 3, 4, 6, 8, 12, 16]))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
            lo, hi = ax.get_xlim()
            ax.set_xlim(lo, hi * 1.6)  # room for the labels right of the points
            ax.set_xlabel(label, fontsize=9)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{mode} cache", fontsize=10)
        for row in range(2):
            axes[row][0].set_ylabel(f"accuracy on {', '.join(tables['tasks'])} (%)")
    shown = {p["method"] for p in points if p["method"] != "none"}
    order = [m for m in styles if m in shown] + sorted(shown - set(styles))  # registration order, then the rest
    handles = [plt.Line2D([], [], linestyle="", marker="o", color=style(m)[0], markeredgecolor="black",
                          label=style(m)[1]) for m in order]
    handles += [plt.Line2D([], [], linestyle="", marker=markers[b], color="white", markeredgecolor="black",
                           label=f"{b}-bit") for b in widths]
    handles += [plt.Line2D([], [], linestyle="", marker="*", color="black", markersize=12, label="cache only"),
                plt.Line2D([], [], linestyle=":", color="grey", label="full recompute")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("Accuracy against KV memory: up and to the left is better", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serve_load(rows: Sequence[Mapping[str, float]], path: Path, title: str = "") -> Path:
    """Two panels against concurrent clients (``benchmarks/serve_load.py`` rows; ``clients`` 0 is the sequential
    baseline, drawn as dashed lines): generated tokens/s, and latency p50 / p90 / p99 (s)."""
    levels = [r for r in rows if r["clients"] > 0]
    base = next((r for r in rows if r["clients"] == 0), None)
    clients = [r["clients"] for r in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(clients, [r["tok_per_s"] for r in levels], marker="o", label="concurrent clients")
    if base is not None:
        left.axhline(base["tok_per_s"], color="grey", linestyle="--", label="one request at a time")
    for r in levels:
        left.annotate(f"batch {r['mean_batch']:.1f}", (r["clients"], r["tok_per_s"]), textcoords="offset points",
                      xytext=(0, 7), ha="center", fontsize=8)
    left.set_ylabel("generated tokens / s")
    left.set_ylim(0, 1.15 * max([r["tok_per_s"] for r in rows]))  # room for the batch labels
    left.set_title("throughput (labels: mean batch the server formed)", fontsize=10)
    for key, style in (("p50_s", "o-"), ("p90_s", "s--"), ("p99_s", "^:")):
        right.plot(clients, [r[key] for r in levels], style, label=key.removesuffix("_s"))
    if base is not None:
        right.axhline(base["p50_s"], color="grey", linestyle="--", label="p50, one at a time")
    right.set_ylabel("latency per request (s)")
    right.set_title("latency", fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        if ax is right:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
