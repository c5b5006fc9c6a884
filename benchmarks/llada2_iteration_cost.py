"""What one iteration of LLaDA2's running batch costs, in machine-independent counts (issue 31).

The model has LLaDA2.0-mini's layout: 20 layers (layer 0 dense), 16 query / 4 KV heads, 256 experts, top 8 in 8
groups (4 kept), one shared expert; the widths are shrunk so that the arithmetic is small (head dim 8, width 128,
expert hidden 16, dense hidden 256, vocabulary 4096: counts do not depend on them). Each request: a 200-token
prompt (different per row), 256 generated, block 32, 8 steps per block with no threshold (every row takes part in
every step), cache mode ``block``; rows at 1, 8, 32. For a **block-initial iteration** (every row's first forward
of its first response block: its prompt's whole blocks and the active block) and a **later-step iteration** (the
active block alone over the committed K/V) it prints: tensor ops (aten operations dispatched, views included),
host syncs (`benchmarks.iteration_cost.Counter`), of them those outside the MoE layers (the total less the MoE
layers' own: none with ``grouped_mm``, whose group offsets stay on the device; one expert-count read each on the
per-expert fallback), forwards and the most rows in one, and for one MoE layer of the later-step forward its ops,
syncs and the experts active in it (the ops are the same whatever the rows and the active experts).
``--kv-quant kivi`` gives every request a 4-bit KIVI store, ``--kv-quant dllm_kvq`` a 4-bit dLLM-KVQ store (one
protected K token per group of 32, by attention score): the committed blocks are quantized in the block-initial
iteration (`service.quant.committed`, one quantize/dequantize per committing row and layer, the writes' checks
joined to the iteration's one host read) and held packed; later steps dequantize them at every layer (one
dequantize per committed block, row and layer).

Usage: ``python benchmarks/llada2_iteration_cost.py [--rows 1,8,32] [--layers 20] [--kv-quant none|kivi|dllm_kvq]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not a package
from benchmarks.iteration_cost import Counter, ForwardCount
from service.artifacts.base import Provenance
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort
from service.engine.models.llada2 import LLaDA2Config, LLaDA2Model
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store


def mini_layout(layers: int, vocab: int, head_dim: int = 8) -> LLaDA2Model:
    """A random LLaDA2 model with LLaDA2.0-mini's layer and expert layout, widths shrunk (module doc; the head
    dim is mini's 128 where K/V bytes are measured, half of it rotated)."""
    config = LLaDA2Config(
        arch="llada2", vocab_size=vocab, width=128, num_layers=layers, num_heads=16, num_kv_heads=4,
        head_dim=head_dim,
        mlp_hidden=256, eps=1e-6, rope_theta=600000.0, rope_full_precision=False, qkv_bias=False,
        mask_id=vocab - 1, eos_id=vocab - 4, pad_id=vocab - 4, max_length=4096, rotary_dim=head_dim // 2, first_dense=1,
        num_experts=256, experts_per_token=8, expert_groups=8, groups_per_token=4, moe_hidden=16,
        shared_experts=1, routed_scale=2.5,
    )
    torch.manual_seed(0)
    model = LLaDA2Model(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return model.eval().requires_grad_(False)


def spec_of(model: LLaDA2Model) -> ModelSpec:
    """The spec of ``model`` made from its config (no checkpoint, no fingerprint)."""
    c = model.config
    return ModelSpec(arch=c.arch, model_id="mini-layout", fingerprint="none", num_layers=c.num_layers,
                     num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     vocab_size=c.vocab_size, mask_id=c.mask_id, eos_ids=(c.eos_id,), pad_id=c.pad_id,
                     max_length=c.max_length)


def quant_store(model: LLaDA2Model, method: str, bits: int = 4):
    """A 4-bit KIVI or dLLM-KVQ store for ``model`` (its spec made from the config; dLLM-KVQ with one protected K
    token per group of 32 on every layer, by attention score, a ``prefix`` policy: the one ``block`` serves)."""
    spec, c = spec_of(model), model.config
    if method == "kivi":
        return make_kv_store(KVQuantConfig(method="kivi", bits=bits, v_group_size=c.head_dim), spec,
                             attention="torch")
    policy = PolicyTable(model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode="prefix",
                         bits=bits, k_group_size=32, v_group_size=c.head_dim, k_bit_cap=16.0,
                         layers=[LayerPolicy(score_type="attention", p=1)] * c.num_layers,
                         provenance=Provenance(data="none", code="benchmarks/llada2_iteration_cost.py"))
    return make_kv_store(KVQuantConfig(method="dllm_kvq", bits=bits, v_group_size=c.head_dim,
                                       artifact_id=policy.id), spec, policy, attention="torch")


def measure(model: LLaDA2Model, rows: int, kv_quant: str = "none") -> dict[str, float]:
    """Counts of a block-initial and a later-step iteration of ``rows`` requests (module doc)."""
    gen = torch.Generator().manual_seed(rows)
    vocab = model.config.vocab_size
    settings = BlockCausalParams(gen_length=256, block_length=32, steps=8, threshold=float("inf"))
    batch = BlockCausalBatch(model)
    for _ in range(rows):
        prompt = torch.randint(0, vocab - 8, (200,), generator=gen).tolist()
        store = quant_store(model, kv_quant) if kv_quant != "none" else None
        batch.join(BlockCausalCohort(model, [prompt], [settings], model.config.mask_id, (model.config.eos_id,),
                                     kv_store=store))
    out = {}
    with torch.inference_mode():
        for kind in ("block-initial", "later-step"):
            with Counter() as counter, ForwardCount(model) as forwards:
                batch.step()
            out[kind] = (counter.ops, counter.syncs, forwards.calls, forwards.most_rows)
        moe = model.layers[1].mlp
        x = torch.randn(rows, 32, model.config.width, generator=gen)
        with Counter() as counter:
            moe(x)
        active = int((torch.bincount(moe.route(x.reshape(-1, x.shape[-1]))[0].reshape(-1), minlength=256) > 0).sum())
        out["moe"] = (counter.ops, counter.syncs, active)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="row counts, comma-separated (default 1,8,32)")
    parser.add_argument("--layers", type=int, default=20, help="layers (default 20, LLaDA2.0-mini's)")
    parser.add_argument("--kv-quant", default="none", choices=("none", "kivi", "dllm_kvq"),
                        help="4-bit KIVI or dLLM-KVQ committed blocks")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = mini_layout(args.layers, 4096)
    moe_layers = sum(1 for layer in model.layers if hasattr(layer.mlp, "route"))
    print("| rows | iteration | tensor ops | host syncs | outside MoE | forwards | rows/fwd | MoE layer ops | syncs "
          "| active experts |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        counts = measure(model, rows, args.kv_quant)
        moe_ops, moe_syncs, active = counts["moe"]
        for kind in ("block-initial", "later-step"):
            ops, syncs, calls, most = counts[kind]
            moe = f"{moe_ops} | {moe_syncs} | {active}" if kind == "later-step" else "| |"
            print(f"| {rows} | {kind} | {ops} | {syncs} | {syncs - moe_layers * moe_syncs} | {calls} | {most} | {moe} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
