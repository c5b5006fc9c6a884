"""``generate`` on a renoising model (DiffusionGemma): its flags and its decode (`service.engine.renoise`).

The flags are the reference ``generate``'s settings: ``--max-denoising-steps``, ``--entropy-bound`` (its
``sampler_config.entropy_bound``), ``--t-max``, ``--t-min``, ``--stability-threshold``, ``--confidence-threshold``;
``--gen-length`` is its ``max_new_tokens``. A flag not given takes the checkpoint's ``generation_config.json`` value,
else the reference's default (48, 0.1, 0.8, 0.4, 1, 0.005). ``--seed S`` draws what ``torch.manual_seed(S)`` then
the reference's ``generate`` draws at batch 1 (same calls, same order, on a generator seeded S); without it, torch's
global generator (unseeded) draws. The EOS and pad ids are the checkpoint's ``generation_config.json``'s, as the
reference reads them (none there: no EOS stop).

``--json`` prints one object: ``generated_ids`` (the reference's new tokens as it returns them: every committed
canvas whole, the tokens after the first EOS replaced by the pad id; **not** cut after the EOS nor at
``--gen-length``), ``generated_ids_to_eos`` (the same cut after the first EOS), ``nfe`` (decoder passes, the
reference's ``decoder_forward_passes``), ``encoder_passes``, ``steps_per_canvas``, ``finish_reason``, ``text``,
``kv_bytes`` (the row's committed K/V held at the end, per layer kind), ``params`` (the settings as run),
``timings`` and ``kv`` (with ``--kv-quant``: the store's report, effective bits and bytes; else null).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

#: Flags (argparse dests: `service.engine.params.RENOISING_FIELDS`, declared with the other decoding settings in
#: `DecodeSettings`, so ``serve`` and the request fields take the same names) -> `RenoiseParams` fields.
FLAGS = {"max_denoising_steps": "max_denoising_steps", "entropy_bound": "entropy_bound", "t_max": "t_max",
         "t_min": "t_min", "stability_threshold": "stability_threshold",
         "confidence_threshold": "confidence_threshold"}


def given_settings(args: argparse.Namespace) -> dict:
    """The renoising flags given, parsed and bounded as `DecodeSettings` fields (a flag's value is text).

    Raises:
        pydantic.ValidationError: a value outside a field's bounds.
    """
    from service.engine.params import DecodeSettings

    given = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    settings = DecodeSettings(**given)
    return {name: getattr(settings, name) for name in given}


def _refuse_other_flags(args: argparse.Namespace) -> None:
    """The masked families' settings have no meaning here: refused in one line naming the flag."""
    from service.engine.errors import EngineInputError
    from service.engine.params import RENOISING_FIELDS, DecodeSettings

    # Every decoding flag of the masked families (generated from DecodeSettings) and LLaDA2's own: none has a
    # meaning here, and one given was silently ignored (--cache-mode was, found by a review).
    names = [n for n in DecodeSettings.model_fields if n not in RENOISING_FIELDS] + ["steps_per_block"]
    for name in names:
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            why = ("its decoder always reads the committed canvases' cache (there is no recompute mode)"
                   if name == "cache_mode" else "it is a setting of the masked families")
            raise EngineInputError(f"{flag} is not a setting of a renoising model (DiffusionGemma): {why}; its "
                                   "settings are --max-denoising-steps, --entropy-bound, --t-max, --t-min, "
                                   "--stability-threshold, --confidence-threshold", name)
    if args.temperature:
        raise EngineInputError("--temperature is not a setting of a renoising model: its temperature follows "
                               "--t-max .. --t-min over the steps", "temperature")


def _as_flag(exc):
    """``exc`` (`RenoiseParams`'s refusal, which names the reference's field) naming the flag the user typed
    instead: ``max_new_tokens`` is ``--gen-length`` here, ``t_max`` is ``--t-max`` (a value from the checkpoint's
    ``generation_config.json`` is named the same way: the flag is how the user overrides it)."""
    from service.engine.errors import EngineInputError

    field = exc.field or ""
    dest = "gen_length" if field == "max_new_tokens" else field
    flag = "--" + dest.replace("_", "-")
    message = str(exc)
    if field and message.startswith(field):
        message = flag + message[len(field):]
    return EngineInputError(message, dest)


def run(args: argparse.Namespace, engine, prompt: list[int], kv_store=None) -> int:
    """Decode ``prompt`` by renoising and print (plain: the text or ids and a report line; ``--json``: see the
    module doc). Returns 0.

    ``kv_store``: the ``--kv-quant`` store (`service.quant.store.make_kv_store`); a quantized one holds the
    committed K/V packed (`service.quant.canvas`) and its report (effective bits, bytes) is the JSON's ``kv``.

    Raises:
        EngineInputError: a flag of the other families, or a value the reference refuses.
        KVQuantError: a KV configuration the family cannot run (`service.quant.canvas.check_geometry`).
    """
    import torch

    from service.engine.errors import EngineInputError
    from service.engine.loading import resolve_checkpoint_dir
    from service.engine.models.diffusion_gemma import CanvasCache
    from service.engine.renoise import RenoiseParams, generate
    from service.engine.renoise_settings import stop_ids

    _refuse_other_flags(args)
    directory = resolve_checkpoint_dir(args.model)
    try:
        params = RenoiseParams.for_checkpoint(directory, max_new_tokens=args.gen_length,
                                              **{FLAGS[dest]: value for dest, value in given_settings(args).items()})
    except EngineInputError as exc:
        raise _as_flag(exc) from None
    eos_ids, pad_id = stop_ids(directory)
    generator = torch.Generator(device=engine.device).manual_seed(args.seed) if args.seed is not None else None
    held: list[CanvasCache] = []
    began = time.perf_counter()
    result = generate(engine.model, [prompt], params, eos_ids, pad_id, generator, mode="shared", caches=held,
                      kv_store=kv_store)[0]
    total = time.perf_counter() - began
    cut = result.ids_to_eos(eos_ids)
    text = engine.decode_text(cut)
    kv = kv_store.report() if kv_store is not None else None
    if not args.json:
        print(text if text is not None else ",".join(map(str, result.generated_ids)))
        bits = f" kv_bits=K{kv.k_nominal_bits:.2f}/V{kv.v_nominal_bits:.2f}" if kv is not None else ""
        print(f"[finish={result.finish_reason} tokens={len(result.generated_ids)} nfe={result.nfe} "
              f"steps/canvas={result.steps_per_canvas}{bits} time={total:.2f}s]")
        return 0
    print(json.dumps({
        "generated_ids": result.generated_ids, "generated_ids_to_eos": cut, "nfe": result.nfe,
        "encoder_passes": result.encoder_passes, "steps_per_canvas": result.steps_per_canvas,
        "finish_reason": result.finish_reason, "text": text, "kv_bytes": held[0].row_bytes(0) if held else None,
        "params": asdict(params), "timings": {"total_s": total},
        "kv": kv.model_dump(mode="json") if kv is not None else None,
    }))
    return 0
