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
METHOD_COLORS = {"kivi": "tab:blue", "kvquant": "tab:orange", "dllm_kvq": "tab:green"}
METHOD_NAMES = {"kivi": "KIVI", "kvquant": "KVQuant", "dllm_kvq": "dLLM-KVQ"}
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


def plot_tradeoff(tables: Mapping[str, Any], path: Path, model: str | None = None) -> Path | None:
    """Two panels, accuracy (%) against KV KiB held and against effective bits (nominal, measured), one point per
    (cache mode, method, bit width) of ``model``; the cache-only rows (bf16) as black stars, full recompute as a
    dotted line. Returns None (and writes nothing) when the matrix has no quantized row."""
    points = tradeoff_points(tables, model)
    if not any(p["method"] != "none" for p in points):
        return None
    reference = next((r["average"] for b in tables["blocks"] for r in b["rows"]
                      if r["cache_mode"] == "none" and r["average"] is not None), None)
    tasks = ", ".join(tables["tasks"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    axis_labels = (("kib", "KV held at the peak request (KiB; cache only: the same K/V in bf16)"),
                   ("bits_nominal", "effective bits per K/V element (nominal, measured; mean of K and V)"))
    for ax, (x, label) in zip(axes, axis_labels):
        for p in points:
            if p[x] is None:
                continue
            if p["method"] == "none":
                ax.scatter(p[x], p["accuracy"], marker="*", s=180, color="black", zorder=3)
                ax.annotate(f"cache only ({p['mode']})", (p[x], p["accuracy"]), textcoords="offset points",
                            xytext=(-6, 8), ha="right", fontsize=8)
                continue
            ax.scatter(p[x], p["accuracy"], marker=MODE_MARKERS.get(p["mode"], "^"), s=70,
                       color=METHOD_COLORS.get(p["method"], "tab:gray"), edgecolor="black", linewidth=0.5, zorder=3)
            ax.annotate(f"{p['bits']}b", (p[x], p["accuracy"]), textcoords="offset points", xytext=(6, -3),
                        fontsize=8)
        if reference is not None:
            ax.axhline(reference, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"accuracy on {tasks} (%)")
    handles = [plt.Line2D([], [], linestyle="", marker="o", color=c, markeredgecolor="black", label=METHOD_NAMES[m])
               for m, c in METHOD_COLORS.items() if any(p["method"] == m for p in points)]
    handles += [plt.Line2D([], [], linestyle="", marker=mk, color="white", markeredgecolor="black",
                           label=f"{mode} cache") for mode, mk in MODE_MARKERS.items()
                if any(p["mode"] == mode for p in points)]
    handles += [plt.Line2D([], [], linestyle="", marker="*", color="black", markersize=12, label="cache only"),
                plt.Line2D([], [], linestyle=":", color="grey", label="full recompute")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("Accuracy against KV memory: up and to the left is better (labels: code bits)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
