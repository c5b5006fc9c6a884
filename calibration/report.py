"""The calibration report: markdown with matplotlib plots (issue 6 item 8).

* a per-layer policy map (score type and p per layer, one row per cache mode and bits), and per policy its table
  layer by layer (score type, p, nominal K bits, win rates per metric; `calibration.policy_tables`);
* TRACE convergence: per sample the objective at each refinement round and whether the assignment settled;
* win-rate bars per metric (the paper's Table 4: share of records where the selected policy beats the all-K
  quantized baseline), with the effective K bits;
* K and V surfaces of one layer and head across the steps of one block, with the active block marked by red
  planes (the paper's Figures 4 and 5: ``|K|`` / ``|V|`` over token and channel axes, full recompute).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np

from calibration.forward import capture_qkv
from calibration.metrics import METRICS
from calibration.policy_tables import per_layer_markdown, table4_markdown
from calibration.trace import Trajectory, rollout
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
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, key in enumerate(keys):
        offsets = np.arange(len(METRICS)) + (i - (len(keys) - 1) / 2) * width
        configured = rows[key].get("configured_k_bits")
        label = key if configured is None else f"{key} ({configured:.2f} configured K bits)"
        ax.bar(offsets, [rows[key][m] for m in METRICS], width, label=label)
    ax.axhline(50, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(METRICS)), METRICS)
    ax.set_ylim(0, 100)
    ax.set_ylabel("records improved over all-K QDQ (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cache_surfaces(model: DiffusionLM, trajectory: Trajectory, block: int, layer: int, head: int,
                        out: Path, max_steps: int = 4) -> tuple[Path, Path]:
    """``|K|`` and ``|V|`` surfaces (token x channel) of one layer and kv head at up to ``max_steps`` steps of one
    block, from full-recompute forwards of the TRACE states; red planes mark the active block's bounds."""
    schedule = trajectory.schedule
    states = rollout(trajectory.prompt_ids, trajectory.answer_ids, trajectory.assignment, schedule,
                     model.config.mask_id)
    steps = [block * schedule.steps_per_block + s for s in
             np.linspace(0, schedule.steps_per_block - 1, min(max_steps, schedule.steps_per_block)).astype(int)]
    start = len(trajectory.prompt_ids) + block * schedule.block_length
    end = start + schedule.block_length
    captured = {}
    for step in steps:
        _, layers = capture_qkv(model, states[step][None].to(model.embed.weight.device))
        captured[step] = layers[layer]
    paths = []
    for name in ("k", "v"):
        fig = plt.figure(figsize=(4.2 * len(steps), 4))
        for i, step in enumerate(steps):
            surface = getattr(captured[step], name)[0, head].abs().float().cpu().numpy()  # [T, D]
            tokens, channels = np.meshgrid(np.arange(surface.shape[0]), np.arange(surface.shape[1]), indexing="ij")
            ax = fig.add_subplot(1, len(steps), i + 1, projection="3d")
            ax.plot_surface(tokens, channels, surface, cmap="viridis", linewidth=0)
            top = float(surface.max()) or 1.0
            for bound in (start, end - 1):  # the active block's first and last token
                yy, zz = np.meshgrid([0, surface.shape[1] - 1], [0, top])
                ax.plot_surface(np.full_like(yy, bound), yy, zz, color="red", alpha=0.25)
            ax.set_title(f"step {step - block * schedule.steps_per_block} of block {block}", fontsize=9)
            ax.set_xlabel("token")
            ax.set_ylabel("channel")
        fig.suptitle(f"|{name.upper()}| layer {layer}, head {head} (red: active block)")
        fig.tight_layout()
        path = out / f"{name}_surface_layer{layer}_head{head}_block{block}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths[0], paths[1]


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


def write_report(out: Path, tables: Mapping[str, PolicyTable], rows: Mapping[str, Mapping[str, float]],
                 model: DiffusionLM, trajectory: Trajectory, settings: Mapping, seconds: Mapping[str, float],
                 kvquant_states: Mapping[str, str], layer: int | None = None, head: int = 0,
                 fit_layers: Mapping[str, Sequence[Mapping]] | None = None,
                 convergence: Sequence[Mapping] = ()) -> Path:
    """Write ``report.md`` and its PNG plots into ``out``; returns the markdown path.

    ``layer`` defaults to 5 (the paper's figures) or the last layer of a smaller model; the surfaces show the
    trajectory's last block (so the prefix holds the earlier answer blocks). ``fit_layers``: the fit record's
    per-layer entries per policy key (win rates); ``convergence``: TRACE rows per sample.
    """
    out.mkdir(parents=True, exist_ok=True)
    layer = min(5, len(model.layers) - 1) if layer is None else layer
    block = trajectory.schedule.num_blocks - 1
    policy_map = plot_policy_map(tables, out / "policy_map.png")
    win_rates = plot_win_rates(rows, out / "win_rates.png")
    k_surface, v_surface = plot_cache_surfaces(model, trajectory, block, layer, head, out)
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
              "", "## K and V cache surfaces", "",
              (f"Full-recompute |K| and |V| of layer {layer}, kv head {head}, across steps of block {block} of one "
              "calibration trajectory; red planes mark the active block."), "",
              f"![K surfaces]({k_surface.name})", "", f"![V surfaces]({v_surface.name})", "",
              f"Score types: {', '.join(SCORE_TYPES)}.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
