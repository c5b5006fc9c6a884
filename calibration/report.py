"""The calibration report: markdown with matplotlib plots (issue 6 item 8; issue 23: pictures only where they show
something, each with a caption saying what to look for).

* a per-layer policy map (score type and p per layer, one row per cache mode and bits), and per policy its table
  layer by layer (score type, p, configured and measured K bits, win rates per metric; `calibration.policy_tables`);
* TRACE convergence: per sample the objective at each refinement round and whether the assignment settled;
* win-rate bars per metric and the paper's Table 4 (share of records where the selected policy beats the all-K
  quantized baseline; a tie is not a win), with each policy's configured K bits;
* the reuse error of every layer and kv head over the last block of one trajectory (how much the reused K/V
  would have changed under full recompute), and for the head where K's is largest, token x channel maps of
  ``|K|``, ``|V|`` and their change (the paper's Figures 4 and 5 show such surfaces as 3D plots).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import torch

from calibration.forward import capture_qkv
from calibration.metrics import METRICS
from calibration.policy_tables import per_layer_markdown, table4_markdown
from calibration.trace import Trajectory, rollout
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import SCORE_TYPES, PolicyTable
from service.engine.models import DiffusionLM

_SCORE_MARK = {"attention": "A", "qerror": "Q", "hybrid": "H"}


def plot_policy_map(tables: Mapping[str, PolicyTable], path: Path) -> Path:
    """Heat map: rows ``mode/bits``, columns layers, colour p, text ``<score initial><p>`` (``-`` for p = 0)."""
    keys = sorted(tables)
    num_layers = max(t.num_layers for t in tables.values())
    grid = np.zeros((len(keys), num_layers))
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * num_layers + 2), 0.6 * len(keys) + 1.5))
    for row, key in enumerate(keys):
        for layer, choice in enumerate(tables[key].layers):
            grid[row, layer] = choice.p
            label = "-" if choice.p == 0 else f"{_SCORE_MARK[choice.score_type]}{choice.p}"
            ax.text(layer, row, label, ha="center", va="center", fontsize=9)
    image = ax.imshow(grid, cmap="Blues", vmin=0, vmax=max(4, grid.max()), aspect="auto")
    ax.set_xticks(range(num_layers))
    ax.set_yticks(range(len(keys)), keys)
    ax.set_xlabel("layer")
    ax.set_title("policy per layer: A attention, Q qerror, H hybrid; number = p", fontsize=9)
    fig.colorbar(image, ax=ax, label="high-precision budget p")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_win_rates(rows: Mapping[str, Mapping[str, float]], path: Path) -> Path:
    """Grouped bars: win rate (%) per metric, one bar per ``mode/bits`` policy."""
    keys = sorted(rows)
    width = 0.8 / max(1, len(keys))
    fig, ax = plt.subplots(figsize=(10.5, 3.8))
    for i, key in enumerate(keys):
        offsets = np.arange(len(METRICS)) + (i - (len(keys) - 1) / 2) * width
        configured = rows[key].get("configured_k_bits")
        label = key if configured is None else f"{key} ({configured:.3f} configured K bits)"
        ax.bar(offsets, [rows[key][m] for m in METRICS], width, label=label)
    ax.axhline(50, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(METRICS)), METRICS)
    ax.set_ylim(0, 100)
    ax.set_ylabel("records improved over all-K QDQ (%)")
    ax.set_title("win rate per metric (a tie is not a win: a record where policy and baseline agree is not counted "
                 "as one)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reuse_error(model: DiffusionLM, trajectory: Trajectory, block: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """How stale a reused cache gets within one block: for every layer and kv head, the relative change
    ``||X_last - X_first|| / ||X_first||`` of K and of V over the tokens outside the active block, between the
    block-initial pass (what prefix and dual cache reuse) and the block's last step, both under full recompute.

    Returns:
        (k_error, v_error) float arrays ``[layers, kv heads]``, and the captures of both steps (per layer
        ``LayerQKV`` with ``k``/``v`` ``[1, H_kv, T, D]``) and the active block's [start, end) token range.
    """
    schedule = trajectory.schedule
    states = rollout(trajectory.prompt_ids, trajectory.answer_ids, trajectory.assignment, schedule,
                     model.config.mask_id)
    first, last = block * schedule.steps_per_block, (block + 1) * schedule.steps_per_block - 1
    device = model.embed.weight.device
    _, at_first = capture_qkv(model, states[first][None].to(device))
    _, at_last = capture_qkv(model, states[last][None].to(device))
    start = len(trajectory.prompt_ids) + block * schedule.block_length
    end = start + schedule.block_length
    outside = torch.ones(at_first[0].k.shape[2], dtype=torch.bool)
    outside[start:end] = False
    errors = []
    for name in ("k", "v"):
        rows = []
        for a, b in zip(at_first, at_last):
            x, y = getattr(a, name)[0][:, outside].float(), getattr(b, name)[0][:, outside].float()
            rows.append(((y - x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1).clamp_min(1e-12)).cpu().numpy())
        errors.append(np.stack(rows))
    return errors[0], errors[1], (at_first, at_last, start, end)


def plot_reuse_error(k_error: np.ndarray, v_error: np.ndarray, path: Path) -> Path:
    """Heat maps (layer x kv head) of the relative reuse error of K and V (`reuse_error`), values printed."""
    fig, axes = plt.subplots(1, 2, figsize=(2.2 + 1.1 * k_error.shape[1] * 2, 1.6 + 0.45 * k_error.shape[0]),
                             squeeze=False)
    top = float(max(k_error.max(), v_error.max())) or 1.0
    for ax, (name, grid) in zip(axes[0], (("K", k_error), ("V", v_error))):
        image = ax.imshow(grid, cmap="Reds", vmin=0, vmax=top, aspect="auto")
        for (layer, head), value in np.ndenumerate(grid):
            ax.text(head, layer, f"{100 * value:.1f}%", ha="center", va="center", fontsize=8,
                    color="white" if value > 0.6 * top else "black")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
        ax.set_xlabel("kv head")
        ax.set_ylabel("layer")
        ax.set_title(f"{name}: change of the reused tokens\nover one block (relative)", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="||last step - block-initial|| / ||block-initial||")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_kv_surfaces(captures: tuple, layer: int, head: int, path: Path) -> Path:
    """For one layer and kv head, token x channel maps: ``|K|`` and ``|V|`` of the block-initial pass, and how
    much each entry changed by the block's last step; the active block is hatched, and each colour scale ends at
    the 99.5th percentile of the reused tokens (brighter entries inside the block are clipped)."""
    at_first, at_last, start, end = captures
    panels = [("|K| at the block-initial pass", at_first[layer].k[0, head].abs(), "viridis"),
              ("|V| at the block-initial pass", at_first[layer].v[0, head].abs(), "viridis"),
              ("|K last step - K block-initial|", (at_last[layer].k[0, head] - at_first[layer].k[0, head]).abs(),
               "Reds"),
              ("|V last step - V block-initial|", (at_last[layer].v[0, head] - at_first[layer].v[0, head]).abs(),
               "Reds")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    for ax, (title, values, cmap) in zip(axes.flat, panels):
        grid = values.float().cpu().numpy().T  # [D, T]: channels down, tokens across
        # The colour scale follows the reused tokens (the active block's masked positions would flatten them).
        reused = np.concatenate([grid[:, :start], grid[:, end:]], axis=1)
        top = float(np.percentile(reused, 99.5)) if reused.size else None
        image = ax.imshow(grid, cmap=cmap, aspect="auto", interpolation="nearest", vmin=0, vmax=top or None)
        ax.axvspan(start - 0.5, end - 0.5, fill=False, hatch="///", edgecolor="black", alpha=0.35, linewidth=0)
        ax.axvline(start - 0.5, color="black", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("token position (hatched: the active block, recomputed at every step)")
        ax.set_ylabel("channel")
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"layer {layer}, kv head {head} (the largest K reuse error)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _change(value: float | None) -> str:
    return "— (one round)" if value is None else f"{value:+.4f}"


def convergence_markdown(rows: Sequence[Mapping], round_limit: int) -> list[str]:
    """TRACE convergence: one row per sample (`calibration.job.convergence_row`)."""
    settled = sum(1 for r in rows if r["settled"])
    lines = [(f"{settled} of {len(rows)} samples settled (the assignment stopped changing) within the limit of "
             f"{round_limit} refinement round(s) (`--rounds`). Objective: sum over answer tokens of the "
             "log-probability of revealing each at its assigned step (nats), after each round."), "",
             "| Sample | Rounds | Objective per round (nats) | Last change | Settled |", "|---|---:|---|---:|---|"]
    for r in rows:
        state = {True: "yes", False: "no", None: "not recorded"}[r["settled"]]
        lines.append(f"| `{r['trajectory'][:14]}` | {r['rounds']} | "
                     + ", ".join(f"{o:.3f}" for o in r["objectives"]) + f" | {_change(r['last_change'])} | {state} |")
    return lines + [""]


def write_run_report(out: Path, fitted: Mapping[str, Mapping[str, Any]], rows: Mapping[str, Mapping[str, float]],
                     model: DiffusionLM, trajectory: Trajectory, settings: Mapping, seconds: Mapping[str, float],
                     fit_layers: Mapping[str, Sequence[Mapping]] | None = None,
                     convergence: Sequence[Mapping] = ()) -> Path:
    """:func:`write_report` from a run's fitted artifacts by method (`CalibrationJob.run_steps`): its policy
    tables and KVQuant states, told apart by type (an artifact of another type is not in the report)."""
    artifacts = [(key, artifact) for per_method in fitted.values() for key, artifact in per_method.items()]
    tables = {key: a for key, a in artifacts if isinstance(a, PolicyTable)}
    states = {key: a.id for key, a in artifacts if isinstance(a, KVQuantState)}
    return write_report(out, tables, rows, model, trajectory, settings, seconds, states, fit_layers=fit_layers,
                        convergence=convergence)


def write_report(out: Path, tables: Mapping[str, PolicyTable], rows: Mapping[str, Mapping[str, float]],
                 model: DiffusionLM, trajectory: Trajectory, settings: Mapping, seconds: Mapping[str, float],
                 kvquant_states: Mapping[str, str],
                 fit_layers: Mapping[str, Sequence[Mapping]] | None = None,
                 convergence: Sequence[Mapping] = ()) -> Path:
    """Write ``report.md`` and its PNG plots into ``out``; returns the markdown path.

    The K/V pictures use the trajectory's last block (so the reused prefix holds the prompt and the earlier
    answer blocks): the reuse error of every layer and head, then the surfaces of the head where K's is largest.
    ``fit_layers``: the fit record's per-layer entries per policy key (win rates); ``convergence``: TRACE rows
    per sample.
    """
    out.mkdir(parents=True, exist_ok=True)
    block = trajectory.schedule.num_blocks - 1
    policy_map = plot_policy_map(tables, out / "policy_map.png")
    win_rates = plot_win_rates(rows, out / "win_rates.png")
    k_error, v_error, captures = reuse_error(model, trajectory, block)
    layer, head = (int(i) for i in np.unravel_index(np.argmax(k_error), k_error.shape))
    error_map = plot_reuse_error(k_error, v_error, out / "reuse_error.png")
    surfaces = plot_kv_surfaces(captures, layer, head, out / f"kv_surfaces_layer{layer}_head{head}_block{block}.png")
    lines = ["# dLLM-KVQ calibration report", "",
             f"Model fingerprint `{trajectory.model_fingerprint[:16]}...`; settings:", "", "```",
             *(f"{k}: {v}" for k, v in settings.items()), "```", "",
             "Time per step (s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()), "",
             "## Policies", "", "| policy | id | per layer (score type, p) |", "|---|---|---|"]
    for key in sorted(tables):
        table = tables[key]
        layers = ", ".join(f"{c.score_type}/{c.p}" if c.p else "-/0" for c in table.layers)
        lines.append(f"| {key} | `{table.id}` | {layers} |")
    lines += ["", f"![policy map]({policy_map.name})", "", "### Per-layer policy tables", "",
              ("Win rates: share of the layer's calibration records (%) where its choice beats quantizing every K "
              "token. Configured K bits: the layer's nominal K bits on full groups, the figure every report of "
              "the policy shows; measured: the nominal K bits over the calibration's reused tokens, where a "
              "segment shorter than a group still keeps p tokens at 16 bits (docs/glossary.md)."), ""]
    for key in sorted(tables):
        lines += per_layer_markdown(key, tables[key], (fit_layers or {}).get(key))
    lines += ["## TRACE convergence", "", *convergence_markdown(convergence, settings.get("rounds", 0)),
              "## Trajectory diagnostics (Table 4)", "",
              *table4_markdown(rows), f"![win rates]({win_rates.name})", "",
              "## KVQuant states", "", *(f"- {bits} bits: `{state}`" for bits, state in sorted(kvquant_states.items())),
              "", "## Where the reused K/V goes stale", "",
              (f"Block {block} of one calibration trajectory, full recompute. Left: per layer and kv head, how much "
               "the K and V of the tokens outside the active block change between the block-initial pass (what "
               "the prefix and dual caches reuse for the whole block) and the block's last step. What to look "
               "for: the cells with the largest error are where reuse, and quantization on top of it, costs the "
               "most; a policy that protects K tokens on those layers spends its bits where they matter. K "
               f"changes most at layer {layer}, head {head} ({100 * k_error[layer, head]:.1f}%)."), "",
              f"![reuse error]({error_map.name})", "",
              (f"Layer {layer}, kv head {head}. Top: |K| and |V| of the block-initial pass, channels down, tokens "
               "across. What to look for: horizontal bands (channels large on every token). K is quantized per "
               "channel over groups of tokens, so each band gets its own range; V is quantized per token, so a "
               "band in V widens every token's range. Bottom: how much each entry changed by the block's last "
               "step (colour scales follow the reused tokens; brighter entries in the block are clipped). Inside the "
               "hatched active block every step recomputes it; the columns that change outside it are reused "
               "tokens the cache keeps stale, the reuse error that quantization adds to."), "",
              f"![K and V surfaces]({surfaces.name})", "",
              f"Score types: {', '.join(SCORE_TYPES)}.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
