"""The steps of `benchmarks/gpu_check.sh` that no other benchmark measures, and the check's one table (issue 41).

* ``later-step``: the measured time of one later-step iteration of a running batch of ``rows`` requests (one row
  each, prompt 200, 256 generated, block 32, 8 fixed steps per block, dual cache), LLaDA-8B's shape with random
  weights (`benchmarks.decode_speed.random_engine`), with the engine's default later steps (on CUDA: replayed from
  CUDA graphs, `service.engine.graphs`; ``none-eager`` runs the same unquantized rows with graphs off). After the
  block-initial iteration and two later steps (the graphs' warm-up and capture), the median of four later steps,
  each between two syncs; against the roofline of `benchmarks/iteration_cost.py` (one weight read plus each row's
  K/V read once, at LLaDA-8B bf16 on an H200). Writes a JSON list.
* ``llada2``: tokens/s of LLaDA2.0-mini's shape (random weights; 20 layers, width 2048, 16/4 heads of 128, 256
  experts of 512, top 8, one shared, dense layer 0 of 5120, vocabulary 157184, as its public ``config.json``
  gives them) decoding 256 tokens in ``block`` mode (block 32, 8 steps per block) at 1 and 32 rows, unquantized
  and 4-bit KIVI. Recorded with no target (SGLang reports 426 tokens/s for LLaDA2.1-mini, one request, on a B200).
  The unquantized rows' later steps are replayed from CUDA graphs (`service.engine.block_causal_graphs`; on the
  CPU of the dry run, their stand-ins), as the engine runs them by default; ``--no-graphs`` runs them eagerly.
* ``reference``: batch 1 against the Fast-dLLM reference's own ``generate_with_dual_cache`` (NVlabs/Fast-dLLM
  commit 24cc59e, ``llada/generate.py`` and ``llada/model``, whose folder ``--fastdllm`` names: the reference's
  code is not in this repository; it needs ``einops``) on the same random weights at LLaDA-8B's shape (ours
  handed over under the public checkpoint's names, `DiffusionLM.checkpoint_state_dict`): a 200-token prompt,
  256 generated, block 32, 8 fixed steps per block; tokens/s of each (after a warm-up decode of one block each),
  the speedup and whether the tokens are identical. Writes a JSON object.
* ``table``: reads a run's folder and prints ONE table: each target of issue 41's "Targets on one H200" and item
  5's ratios, the measured figure, PASS or FAIL (``NOT RUN`` where a step wrote nothing; ``recorded`` where
  there is no target yet; a dry run's tests row ``collected N``: it only collects them).

``--tiny`` shapes (the dry run on a CPU, `gpu_check.sh --dry-run`): every step at a shape that runs in seconds;
its figures mean nothing.

Usage: ``python benchmarks/gpu_steps.py later-step|llada2|table [options]`` (``--help`` on each).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package

#: Issue 41's targets (and item 5's): later-step time over its roofline, the dual cache's share of HBM peak,
#: KIVI's time against the dual cache at 4 and 2 bits, dLLM-KVQ's against KIVI at the same bits.
LATER_STEP_OVER_ROOFLINE = 2.0
DUAL_SHARE_OF_PEAK = 0.35
KIVI_VS_DUAL = {4: 0.8, 2: 0.6}
DLLM_KVQ_VS_KIVI = 1.10
LATER_ROWS = (1, 8, 32, 64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def later_step(argv: list[str]) -> None:
    """The ``later-step`` step (module doc)."""
    from benchmarks.decode_speed import PRESETS, quantized_store, random_engine
    from benchmarks.iteration_cost import ASSUMED_BITS, PEAK_BYTES_PER_S, llada_8b_bytes
    from service.engine.params import DecodeParams
    from service.runtime.scheduler import forward_plan

    parser = argparse.ArgumentParser(prog="gpu_steps.py later-step")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (dry run)")
    parser.add_argument("--rows", default=",".join(map(str, LATER_ROWS)))
    parser.add_argument("--methods", default="none,none-eager,kivi")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", required=True, help="where the figures go")
    args = parser.parse_args(argv)
    preset, prompt_length, gen, block = ("tiny", 24, 32, 8) if args.tiny else ("8b", 200, 256, 32)
    engine = random_engine(preset, getattr(torch, args.dtype), args.device, 10.0)
    graphs = engine.later_steps
    params = DecodeParams(cache_mode="dual", gen_length=gen, block_length=block, threshold=None,
                          steps=8 * gen // block, ignore_eos=True)
    weights, kv_per_token = llada_8b_bytes()
    reused = prompt_length + gen - block
    shape = PRESETS[preset]
    print(f"later-step iteration: {preset} shape ({shape['num_layers']} layers, width {shape['width']}), "
          f"{args.dtype} on {args.device}, prompt {prompt_length}, block {block}; CUDA graphs: "
          f"{'on' if graphs is not None else 'off'}")
    results = []
    gen_ids = torch.Generator().manual_seed(0)
    for method in args.methods.split(","):
        engine.use_graphs(None if method == "none-eager" else graphs)
        base = method.removesuffix("-eager")
        for rows in (int(r) for r in args.rows.split(",")):
            batch = engine.batch(forward_plan(padding_slack=float("inf")))
            for _ in range(rows):
                prompt = torch.randint(3, engine.spec.vocab_size - 1, (prompt_length,), generator=gen_ids).tolist()
                store = None if base == "none" else quantized_store(base, keep=False)(engine)
                batch.join(engine.cohort([prompt], params, None, store))
            seconds = []
            with torch.inference_mode():
                for _ in range(3):  # block-initial, then the graphs' warm-up and capture
                    batch.step()
                for _ in range(4):
                    _sync(engine.device)
                    start = time.perf_counter()
                    batch.step()
                    _sync(engine.device)
                    seconds.append(time.perf_counter() - start)
                for cohort in list(batch.cohorts):
                    batch.leave(cohort)
            kv = rows * reused * kv_per_token * ASSUMED_BITS[base] / 16.0
            roofline = (weights + kv) / PEAK_BYTES_PER_S
            measured = statistics.median(seconds)
            row = {"method": method, "rows": rows, "ms": measured * 1e3, "roofline_ms": roofline * 1e3,
                   "captures": graphs.captures if graphs else 0, "replays": graphs.replays if graphs else 0}
            print(f"  {method:<11}{rows:>4} rows  {row['ms']:>9.2f} ms  roofline {row['roofline_ms']:>6.2f} ms  "
                  f"{measured / roofline:>6.1f}x  (graphs: {row['captures']} captured, {row['replays']} replayed)",
                  flush=True)
            results.append(row)
    engine.use_graphs(graphs)
    Path(args.json).write_text(json.dumps(results, indent=1))


#: LLaDA2.0-mini's ``config.json`` (the fields `LLaDA2Model.config_from_hf` reads), and a tiny one for the dry run.
MINI = {"hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "num_hidden_layers": 20, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 157184, "max_position_embeddings": 4096}
TINY_MINI = {**MINI, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
             "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def llada2_config(shape: dict) -> dict:
    """A full LLaDA2 ``config.json`` dict of ``shape`` (the fixed fields as in tests/data/llada2's checkpoints)."""
    vocab = shape["vocab_size"]
    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "first_k_dense_replace": 1,
            "hidden_act": "silu", "mask_token_id": vocab - 1, "eos_token_id": vocab - 4, "pad_token_id": vocab - 4,
            "moe_router_enable_expert_bias": True, "norm_head": False, "norm_topk_prob": True,
            "num_shared_experts": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6, "rope_scaling": None,
            "rope_theta": 600000.0, "routed_scaling_factor": 2.5, "router_dtype": "fp32",
            "score_function": "sigmoid", "tie_word_embeddings": False, "use_bias": False, "use_qk_norm": True,
            "use_qkv_bias": False, **shape}


def llada2(argv: list[str]) -> None:
    """The ``llada2`` step (module doc)."""
    from benchmarks.llada2_iteration_cost import quant_store
    from service.engine.block_causal import BlockCausalParams
    from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort
    from service.engine.graphs import EagerGraphs, LaterSteps
    from service.engine.models.llada2 import LLaDA2Model

    parser = argparse.ArgumentParser(prog="gpu_steps.py llada2")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (dry run)")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--kv", default="none,kivi")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", required=True)
    parser.add_argument("--no-graphs", action="store_true", help="eager later steps (the server's "
                        "DLLM_CUDA_GRAPHS=false)")
    args = parser.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    config = LLaDA2Model.config_from_hf(llada2_config(TINY_MINI if args.tiny else MINI))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the model's dtype: mini in float32 would be 64 GB
    try:
        with torch.device(device):
            model = LLaDA2Model(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.eval().requires_grad_(False)
    prompt_length, gen = (24, 64) if args.tiny else (200, 256)
    settings = BlockCausalParams(gen_length=gen, block_length=32, steps=8, threshold=float("inf"))
    ids = torch.Generator().manual_seed(0)
    results = []
    print(f"LLaDA2.0-mini shape{' (tiny)' if args.tiny else ''}: {config.num_layers} layers, width {config.width}, "
          f"{args.dtype} on {device}, prompt {prompt_length}, {gen} generated, block 32, 8 steps per block")
    for kv in args.kv.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            graphs = None if args.no_graphs else LaterSteps(capture=True) if device.type == "cuda" else EagerGraphs()
            batch = BlockCausalBatch(model, later_steps=graphs)
            for _ in range(rows):
                prompt = torch.randint(0, config.vocab_size - 8, (prompt_length,), generator=ids).tolist()
                batch.join(BlockCausalCohort(model, [prompt], [settings], config.mask_id, (config.eos_id,),
                                             kv_store=quant_store(model, kv) if kv != "none" else None))
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                while batch.cohorts:
                    batch.step()
            _sync(device)
            seconds = time.perf_counter() - start
            row = {"kv": kv, "rows": rows, "tokens_per_s": rows * gen / seconds,
                   "captures": graphs.captures if graphs else 0, "replays": graphs.replays if graphs else 0,
                   "graph_bytes": graphs.bytes_held if graphs else 0}
            print(f"  {kv:<6}{rows:>4} rows  {row['tokens_per_s']:>9.1f} tokens/s  (graphs: {row['captures']} "
                  f"captured, {row['replays']} replayed, {row['graph_bytes']:,} bytes)", flush=True)
            results.append(row)
    Path(args.json).write_text(json.dumps(results, indent=1))


def reference(argv: list[str]) -> None:
    """The ``reference`` step (module doc)."""
    from benchmarks.decode_speed import random_engine
    from service.engine.params import DecodeParams

    parser = argparse.ArgumentParser(prog="gpu_steps.py reference")
    parser.add_argument("--fastdllm", required=True, help="a Fast-dLLM checkout (its llada/ folder is read)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (dry run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.fastdllm) / "llada"))
    from generate import generate_with_dual_cache  # the reference's own decode loop
    from model.configuration_llada import LLaDAConfig
    from model.modeling_llada import LLaDAModelLM

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    engine = random_engine("tiny" if args.tiny else "8b", dtype, args.device, 10.0)
    c, spec = engine.model.config, engine.spec
    template = Path(__file__).resolve().parents[1] / "tests" / "data" / "fastdllm" / "ckpt" / "llada-tiny"
    hf = {**json.loads((template / "config.json").read_text()), "d_model": c.width, "n_layers": c.num_layers,
          "n_heads": c.num_heads, "n_kv_heads": c.num_kv_heads, "mlp_hidden_size": c.mlp_hidden,
          "vocab_size": c.vocab_size, "embedding_size": c.vocab_size, "mask_token_id": spec.mask_id,
          "eos_token_id": spec.eos_ids[0], "pad_token_id": spec.pad_id, "max_sequence_length": spec.max_length,
          "init_device": str(device)}
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            ref = LLaDAModelLM(LLaDAConfig(**hf))
    finally:
        torch.set_default_dtype(default)
    ref.load_state_dict(engine.model.checkpoint_state_dict())
    ref.eval().requires_grad_(False)
    prompt_length, gen, block = (24, 64, 32) if args.tiny else (200, 256, 32)
    prompt = torch.randint(3, spec.vocab_size - 1, (prompt_length,), generator=torch.Generator().manual_seed(1))
    steps = 8 * gen // block
    params = DecodeParams(cache_mode="dual", gen_length=gen, block_length=block, threshold=None, steps=steps,
                          ignore_eos=True)
    x = prompt[None].to(device)

    def ours(n: int) -> list[int]:
        return engine.generate([prompt.tolist()], params.model_copy(update={"gen_length": n, "steps": 8 * n // block})
                               ).rows[0].generated_ids

    def theirs(n: int) -> list[int]:
        out, _ = generate_with_dual_cache(ref, x, steps=8 * n // block, gen_length=n, block_length=block,
                                          temperature=0.0, threshold=None, mask_id=spec.mask_id)
        return out[0, prompt_length:].tolist()

    ours(block), theirs(block)  # warm-up: one block each
    timed = {}
    for name, decode in (("ours", ours), ("reference", theirs)):
        _sync(device)
        start = time.perf_counter()
        timed[name] = decode(gen)
        _sync(device)
        timed[name + "_s"] = time.perf_counter() - start
    found = {"ours_tokens_per_s": gen / timed["ours_s"], "reference_tokens_per_s": gen / timed["reference_s"],
             "speedup": timed["reference_s"] / timed["ours_s"], "identical": timed["ours"] == timed["reference"]}
    print(f"batch 1 vs the Fast-dLLM reference (generate_with_dual_cache): ours {found['ours_tokens_per_s']:.1f} "
          f"tokens/s, reference {found['reference_tokens_per_s']:.1f} tokens/s, {found['speedup']:.2f}x, "
          f"token-identical: {found['identical']}")
    Path(args.json).write_text(json.dumps(found, indent=1))


def decode_rows(path: Path) -> dict[str, dict[str, float]]:
    """The fixed-schedule rows of a `benchmarks/decode_speed.py` table (name -> tokens/s, time vs the dual cache,
    share of peak when printed)."""
    found = {}
    for line in path.read_text().splitlines():
        fields = line[26:].split()
        if not line.startswith("  ") or len(fields) < 10 or not fields[0].replace(".", "").isdigit():
            continue
        row = {"tokens_per_s": float(fields[0]), "time_vs_dual": float(fields[5].rstrip("x"))}
        if len(fields) >= 12:
            row["share_of_peak"] = float(fields[11].rstrip("%")) / 100
        found[line[2:26].strip()] = row
    return found


def table(argv: list[str]) -> list[tuple[str, str, str]]:
    """The ``table`` step: the check's one table (module doc); returns its rows."""
    parser = argparse.ArgumentParser(prog="gpu_steps.py table")
    parser.add_argument("--out", required=True, help="the run's folder")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows: list[tuple[str, str, str]] = []

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    tests = out / "tests.txt"
    summary = tests.read_text().strip().splitlines()[-1] if tests.exists() and tests.read_text().strip() else ""
    clean = "failed" not in summary and "error" not in summary
    if args.dry_run:  # the dry run only collects the tests (they need CUDA): say so, not PASS
        collected = re.search(r"(\d+) tests? collected", summary)
        rows.append(("kernel and CUDA-graph tests on the device pass", summary or "no output",
                     f"collected {collected.group(1)}" if collected and clean else "FAIL"))
    else:
        rows.append(("kernel and CUDA-graph tests on the device pass", summary or "no output",
                     verdict(bool(re.search(r"\d+ passed", summary)) and clean)))
    later = json.loads((out / "later_step.json").read_text()) if (out / "later_step.json").exists() else []
    for method in ("none", "kivi"):
        for n in LATER_ROWS:
            got = [r for r in later if r["method"] == method and r["rows"] == n]
            name = f"later-step iteration, {n} rows, {'unquantized' if method == 'none' else 'KIVI 4-bit'}: <= " \
                   f"{LATER_STEP_OVER_ROOFLINE:g}x roofline"
            if not got:
                rows.append((name, "-", "NOT RUN"))
                continue
            ratio = got[0]["ms"] / got[0]["roofline_ms"]
            rows.append((name, f"{got[0]['ms']:.2f} ms / {got[0]['roofline_ms']:.2f} ms = {ratio:.1f}x",
                         verdict(ratio <= LATER_STEP_OVER_ROOFLINE)))
    eager = {r["rows"]: r["ms"] for r in later if r["method"] == "none-eager"}
    graphed = {r["rows"]: r["ms"] for r in later if r["method"] == "none"}
    for n in sorted(set(eager) & set(graphed)):
        rows.append((f"CUDA graphs: later step, {n} rows, eager over replayed", f"{eager[n] / graphed[n]:.2f}x",
                     "recorded"))
    decode_path = out / "decode_4k_8.txt"
    decoded = decode_rows(decode_path) if decode_path.exists() else {}
    dual = decoded.get("dual cache")
    name = f"dual-cache decode, 4k reused tokens, batch 8: >= {DUAL_SHARE_OF_PEAK:.0%} of HBM peak"
    if dual is None or "share_of_peak" not in dual:
        rows.append((name, "-", "NOT RUN"))
    else:
        rows.append((name, f"{dual['share_of_peak']:.0%} ({dual['tokens_per_s']:.0f} tokens/s)",
                     verdict(dual["share_of_peak"] >= DUAL_SHARE_OF_PEAK)))
    for bits, target in KIVI_VS_DUAL.items():
        kivi = decoded.get(f"dual+kivi {bits}b")
        name = f"KIVI {bits}-bit time per decode vs the dual cache (4k, batch 8): <= {target}x"
        rows.append((name, f"{kivi['time_vs_dual']:.3f}x", verdict(kivi["time_vs_dual"] <= target))
                    if kivi else (name, "-", "NOT RUN"))
        ours = decoded.get(f"dual+dllm_kvq {bits}b")
        name = f"dLLM-KVQ {bits}-bit time vs KIVI {bits}-bit: <= {DLLM_KVQ_VS_KIVI:.2f}x"
        if kivi and ours:
            ratio = ours["time_vs_dual"] / kivi["time_vs_dual"]
            rows.append((name, f"{ratio:.3f}x", verdict(ratio <= DLLM_KVQ_VS_KIVI)))
        else:
            rows.append((name, "-", "NOT RUN"))
    reference = out / "fastdllm_reference.json"
    name = "batch 1: >= 3x the Fast-dLLM reference's tokens/s, token-identical"
    if reference.exists():
        ref = json.loads(reference.read_text())
        rows.append((name, f"{ref['speedup']:.2f}x, identical: {ref['identical']}",
                     verdict(ref["speedup"] >= 3 and ref["identical"])))
    else:
        rows.append((name, "needs the reference's code (FASTDLLM_DIR, benchmarks/gpu_check.sh)", "NOT RUN"))
    mini = json.loads((out / "llada2.json").read_text()) if (out / "llada2.json").exists() else []
    for r in mini:
        rows.append((f"LLaDA2.0-mini shape, block mode, {r['rows']} rows, {r['kv']}: tokens/s (no target)",
                     f"{r['tokens_per_s']:.1f} ({r.get('replays', 0)} graph replays)", "recorded"))
    if not mini:
        rows.append(("LLaDA2.0-mini shape tokens/s (no target)", "-", "NOT RUN"))
    device = (out / "device.txt").read_text().strip().replace("\n", ", ") if (out / "device.txt").exists() else "?"
    width = max(len(r[0]) for r in rows)
    print(f"\nGPU check, issue 41 ({device}){': DRY RUN at tiny shapes, the figures mean nothing' if args.dry_run else ''}"
          f"; raw outputs in {out}")
    print(f"| {'target':<{width}} | {'measured':<48} | verdict |")
    print(f"|{'-' * (width + 2)}|{'-' * 50}|---------|")
    for name, measured, outcome in rows:
        print(f"| {name:<{width}} | {measured:<48} | {outcome} |")
    return rows


if __name__ == "__main__":
    commands = {"later-step": later_step, "llada2": llada2, "reference": reference, "table": table}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: gpu_steps.py {{{'|'.join(commands)}}} [options]")
    commands[sys.argv[1]](sys.argv[2:])
