"""``generate`` on a block-causal model (LLaDA2.x): its flags and its decode (`service.engine.block_causal`).

The flags are the reference ``generate``'s arguments: ``--steps-per-block`` (its ``steps``), ``--eos-early-stop``,
``--minimal-topk``, and LLaDA2.1's token editing ``--editing-threshold``, ``--max-post-steps``, ``--min-transfer``
(its ``num_to_transfer``). Giving an editing flag decodes with 2.1's algorithm; a 2.1 checkpoint (``llada21_moe``)
edits by default with the reference's defaults (0.9, 16, 1). ``--cache-mode prefix`` or ``dual`` (``dual`` is the
other families' default) decode in the family's own cached mode, ``block``.

``--json`` prints one object: ``generated_ids`` (cut after the first EOS, as the reference returns them), ``nfe``,
``reveals_per_call``, ``finish_reason``, ``text``, ``kv_bytes``, ``params`` (what was decoded, the cache mode as
run), ``timings``, and ``rows`` (one row in the other families' report shape).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from service.engine.params import EDITING_FIELDS, DecodeSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The block-causal flags of ``generate`` (default None: the family's default applies). The 2.1 editing flags
    (``--editing-threshold``, ``--max-post-steps``, ``--min-transfer``) are decoding settings
    (`service.engine.params.DecodeSettings`), added with the others."""
    group = parser.add_argument_group("block-causal decoding (LLaDA2.x; service.engine.block_causal)")
    group.add_argument("--steps-per-block", type=int, default=None,
                       help="forwards per block at most, LLaDA2.0's schedule (default 32)")
    group.add_argument("--eos-early-stop", action="store_true", default=False,
                       help="stop at the first EOS with no mask before it (default: after the EOS's block)")
    group.add_argument("--minimal-topk", type=int, default=None,
                       help="caps steps per block at gen_length // minimal_topk (default 1)")


def params_from(args: argparse.Namespace, editing_default: bool):
    """The :class:`~service.engine.block_causal.BlockCausalParams` the flags describe.

    Raises:
        EngineInputError: a flag of the other families (``--steps``) or a value out of bounds.
        pydantic.ValidationError: an editing flag outside its `DecodeSettings` bounds.
    """
    from service.engine.block_causal import BlockCausalParams
    from service.engine.errors import EngineInputError

    if args.steps is not None:
        raise EngineInputError("--steps (total over blocks) is not a setting of block-causal models; "
                               "use --steps-per-block", "steps")
    # The editing flags are text (`add_model_flags`): read and bounded as the server reads the same settings.
    editing = DecodeSettings(**{name: getattr(args, name) for name in EDITING_FIELDS if getattr(args, name) is not None})
    given = {name: getattr(editing, name) for name in EDITING_FIELDS if getattr(editing, name) is not None}
    if args.minimal_topk is not None:
        given["minimal_topk"] = args.minimal_topk
    if args.steps_per_block is not None:
        given["steps"] = args.steps_per_block
    if args.block_length is not None:
        given["block_length"] = int(args.block_length)
    if args.threshold is not None:
        given["threshold"] = float(args.threshold)
    cache_mode = args.cache_mode or "block"
    return BlockCausalParams(
        gen_length=args.gen_length, cache_mode="none" if cache_mode == "none" else "block",
        eos_early_stop=args.eos_early_stop, temperature=args.temperature,
        editing=editing_default or any(name in given for name in EDITING_FIELDS), **given,
    )


def run(args: argparse.Namespace, engine, prompt: list[int], kv_store=None) -> int:
    """Decode ``prompt`` block-causally and print (plain: the text or ids and a report line; ``--json``: see the
    module doc). Returns 0.

    Raises:
        EngineInputError: see :func:`params_from` and `service.engine.block_causal.generate`; a KV quantization
            method this family's cache cannot run (`service.quant.committed`), or any with ``--cache-mode none``.

    ``kv_store``: the ``--kv-quant`` store (`service.quant.store.make_kv_store`) that quantizes the committed blocks;
    its report (effective bits, bytes) is the JSON's ``kv``.
    """
    import torch

    from service.engine.block_causal_batch import generate
    from service.engine.errors import EngineInputError

    params = params_from(args, editing_default=engine.model.config.editing)
    if args.kv_quant != "none" and params.cache_mode == "none":
        raise EngineInputError(f"--kv-quant {args.kv_quant} quantizes committed blocks' K/V: it needs "
                               "--cache-mode block (none recomputes every block and holds no cache)", "kv_quant")
    generator = torch.Generator(device=engine.device).manual_seed(args.seed) if args.seed is not None else None
    began = time.perf_counter()
    result = generate(engine.model, prompt, params, engine.spec.mask_id, engine.spec.eos_ids, generator, kv_store)
    total = time.perf_counter() - began
    text = engine.decode_text(result.generated_ids)
    kv = kv_store.report() if kv_store is not None else None
    if not args.json:
        print(text if text is not None else ",".join(map(str, result.generated_ids)))
        bits = f" kv_bits=K{kv.k_nominal_bits:.2f}/V{kv.v_nominal_bits:.2f}" if kv is not None else ""
        print(f"[finish={result.finish_reason} tokens={len(result.generated_ids)} nfe={result.nfe} "
              f"cache={params.cache_mode} editing={params.editing}{bits} time={total:.2f}s]")
        return 0
    row = {"generated_ids": result.generated_ids, "text": text, "finish_reason": result.finish_reason,
           "nfe": result.nfe, "reveals_per_step": result.reveals_per_call,
           "tokens_per_second": len(result.generated_ids) / total if total > 0 else 0.0}
    print(json.dumps({
        "generated_ids": result.generated_ids, "nfe": result.nfe, "reveals_per_call": result.reveals_per_call,
        "finish_reason": result.finish_reason, "text": text, "kv_bytes": result.kv_bytes, "params": asdict(params),
        "timings": {"total_s": total}, "rows": [row], "kv": kv.model_dump(mode="json") if kv is not None else None,
    }))
    return 0
