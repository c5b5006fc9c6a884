"""``python -m service generate``: decode one prompt with a checkpoint and print the text and a report.

Plain output is the text (the ids when the checkpoint has no tokenizer) followed by a one-line report; ``--json``
prints the :class:`~service.engine.report.DecodeReport` as one JSON object. Exit code 2 on bad input (the message
says what is legal).
"""

from __future__ import annotations

import argparse
import re
import sys

from service.commands import _block_causal, _renoising, add_model_flags
from service.engine.params import DecodeParams, DecodeSettings


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (argparse type; a bad id is a usage error)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from err


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All flags of ``generate`` (model, prompt, decoding, runtime, output); extend here for new options."""
    parser.add_argument("--model", default=None, help="checkpoint directory or HF repo id (default: the embedded model)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a checkpoint with a tokenizer; this or --prompt-ids is required)")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt token ids, comma-separated: 1,2,3 (this or --prompt is required)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (default: plain text)")
    parser.add_argument("--gen-length", type=int, default=256, help="response length in tokens (default 256)")
    add_model_flags(parser.add_argument_group("decoding (service.engine.params.DecodeSettings)"),
                    DecodeSettings.model_fields, show_default=True)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh draw)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable); cuts the text (default: none)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--json", action="store_true", help="print the full report as one JSON object (default: text and a report line)")
    kv = parser.add_argument_group("KV-cache quantization (cached modes; see service.quant)")
    # No argparse choices: listing the registry's methods imports every quantizer (torch) for --help; the
    # configuration names the legal ones when one is unknown.
    kv.add_argument("--kv-quant", default="none", metavar="METHOD",
                    help="quantize the reused K/V with a registered method: none, kivi, kvquant, dllm_kvq (built in) "
                         "(default none)")
    kv.add_argument("--kv-bits", type=int, choices=[2, 4, 8], default=4, help="code bits (default 4)")
    kv.add_argument("--kv-group-size", type=int, default=32, help="K group size in tokens (default 32)")
    kv.add_argument("--kv-v-group-size", type=int, default=None,
                    help="V group size in channels (default min(32, head_dim))")
    kv.add_argument("--policy", default=None, help="dLLM-KVQ policy table (JSON file), for --kv-quant dllm_kvq (default: none)")
    kv.add_argument("--kvquant-state", default=None, help="fitted KVQuant state (safetensors), for --kv-quant kvquant (default: none)")
    kv.add_argument("--kv-artifact", default=None,
                    help="the fitted artifact file of any method that applies one (--policy and --kvquant-state "
                         "are its spellings for dllm_kvq and kvquant; default: none)")
    kv.add_argument("--kv-key-bias-correction", action="store_true",
                    help="lower each quantized key's attention score by its expected rounding inflation "
                         "(service.quant.key_bias; kivi, dllm_kvq, kvquant; default: off)")
    kv.add_argument("--kv-keep-dequantized", action="store_true",
                    help="keep each layer's dequantized K/V for the whole block (faster, no memory saved in a block; default: off)")
    _block_causal.add_arguments(parser)


def add_parser(subparsers) -> None:
    """Register ``generate`` on the ``python -m service`` subparsers."""
    parser = subparsers.add_parser("generate", help="decode one prompt", description=__doc__)
    add_arguments(parser)
    parser.set_defaults(func=run)


def decode_params(args: argparse.Namespace) -> DecodeParams:
    """The :class:`DecodeParams` the flags describe (a flag not given: the built-in default; ``--steps`` alone
    replaces the default threshold)."""
    given = {name: getattr(args, name) for name in DecodeSettings.model_fields if getattr(args, name) is not None}
    return DecodeParams(gen_length=args.gen_length, **given)


def kv_config(args: argparse.Namespace):
    """The :class:`KVQuantConfig` the ``--kv-*`` flags describe.

    Raises:
        KVQuantError: illegal flags, in one line of the flags' own spellings (``--kv-quant dllm_kvq needs its
            fitted policy table: --policy FILE``), never the configuration's field names (``policy_id``), which
            the command line has no way to set.
    """
    from pydantic import ValidationError

    from service.commands import describe_validation_error
    from service.quant.config import KVQuantConfig
    from service.quant.errors import KVQuantError
    from service.quant.registry import method, spellings

    try:
        entry = method(args.kv_quant)
    except KVQuantError as exc:
        raise KVQuantError(f"--kv-quant {args.kv_quant}: {exc}") from None
    files = [flag for flag, value in (("--policy", args.policy), ("--kvquant-state", args.kvquant_state),
                                      ("--kv-artifact", args.kv_artifact)) if value is not None]
    if entry.artifact is None and files:
        with_artifact = ", ".join(m for m in spellings_owners(spellings()))
        raise KVQuantError(f"{files[0]} is only used by a method with a fitted artifact ({with_artifact}), not "
                           f"--kv-quant {entry.name}")
    if entry.artifact is not None:
        # A method with no flag of its own (one registered by a plug-in) takes its file by --kv-artifact.
        own = FLAGS.get(entry.spelling("artifact_file"), "--kv-artifact")
        if not files:
            raise KVQuantError(f"--kv-quant {entry.name} needs its fitted {entry.artifact.LABEL}: {own} FILE (or "
                               "--kv-artifact FILE)")
        other = [flag for flag in files if flag not in (own, "--kv-artifact")]
        if other:
            raise KVQuantError(f"{other[0]} is for another method than --kv-quant {entry.name}; give {own} FILE")
        if len(files) > 1:
            raise KVQuantError(f"give {own} or --kv-artifact, not both")
    try:
        return KVQuantConfig(
            method=args.kv_quant, bits=args.kv_bits, k_group_size=args.kv_group_size,
            v_group_size=args.kv_v_group_size, artifact_file=args.kv_artifact, policy_file=args.policy,
            kvquant_state_file=args.kvquant_state, keep_dequantized=args.kv_keep_dequantized,
            key_bias_correction=args.kv_key_bias_correction,
        )
    except ValidationError as exc:
        text = describe_validation_error(exc).replace("settings: ", "")
        text = re.sub(r"method '(\w+)'", r"--kv-quant \1", text)
        for name, flag in FLAGS.items():
            text = re.sub(rf"\b{name}\b", flag, text) if "_" in name else text
        raise KVQuantError(text) from None


def spellings_owners(table: dict[str, tuple[str, str]]) -> list[str]:
    """The methods with a fitted artifact, in registration order, from `service.quant.registry.spellings`."""
    return list(dict.fromkeys(owner for owner, _ in table.values()))


#: `KVQuantConfig` fields and the flags that set them, for error messages (the CLI user typed flags, not fields).
FLAGS = {"cache_mode": "--cache-mode", "bits": "--kv-bits", "k_group_size": "--kv-group-size",
         "v_group_size": "--kv-v-group-size", "policy_file": "--policy", "kvquant_state_file": "--kvquant-state",
         "artifact_file": "--kv-artifact", "key_bias_correction": "--kv-key-bias-correction"}


def flag_message(message: str) -> str:
    """``message`` with a leading artifact-file field name (``policy_file 'x' cannot be used ...``) as its flag."""
    field, sep, rest = message.partition(" ")
    return f"{FLAGS[field]}{sep}{rest}" if field.endswith("_file") and field in FLAGS else message


def artifact_flag(args: argparse.Namespace) -> str:
    """The flag (and file) that named the artifact: ``--policy runs/p.json``."""
    for flag, value in (("--policy", args.policy), ("--kvquant-state", args.kvquant_state),
                        ("--kv-artifact", args.kv_artifact)):
        if value is not None:
            return f"{flag} {value}"
    return "the artifact"


def one_line_report(row, timings) -> str:
    """``finish=... tokens=... nfe=... steps/block=[...] tok/s=... time=...s`` for plain output."""
    return (
        f"[finish={row.finish_reason} tokens={len(row.generated_ids)} nfe={row.nfe} "
        f"steps/block={row.steps_per_block} tok/s={row.tokens_per_second:.1f} time={timings.total_s:.2f}s]"
    )


def _decoder(args: argparse.Namespace) -> str:
    """The checkpoint's family's decoder (``DiffusionLM.decoder``): ``bidirectional`` (LLaDA, Dream),
    ``block_causal`` (LLaDA2.x) or ``renoising`` (DiffusionGemma); the last two have their own flags and decode."""
    from service.engine.loading import model_class

    return model_class(args.model).decoder


def run(args: argparse.Namespace) -> int:
    """Load, decode, print; returns the exit code (0, or 2 on bad input with the message on stderr)."""
    from pydantic import ValidationError

    from service.artifacts.base import ArtifactMismatch
    from service.commands import describe_validation_error
    from service.engine import Engine, EngineInputError
    from service.engine.params import RowOptions
    from service.quant.errors import KVQuantError
    from service.quant.registry import resolve_artifact
    from service.quant.store import make_kv_store

    try:
        kind = _decoder(args)
        if kind in ("renoising", "block_causal"):
            engine = Engine.load(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
            prompt = args.prompt_ids if args.prompt_ids is not None else engine.encode_prompt(args.prompt, args.chat)
            quant = kv_config(args)
            store = make_kv_store(quant, engine.spec, resolve_artifact(quant, engine.spec))
            return (_renoising if kind == "renoising" else _block_causal).run(args, engine, prompt, store)
        params = decode_params(args)
        row_options = RowOptions(temperature=args.temperature, seed=args.seed, stop=tuple(args.stop))
        quant = kv_config(args)
        quant.check_cache_mode(params.cache_mode)
        engine = Engine.load(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
        # Policy/state files are read and checked against the model and the cache mode here, before any decoding,
        # by the one resolver the server uses (a policy fitted for another cache mode is refused as it is there).
        artifact = resolve_artifact(quant, engine.spec, cache_mode=params.cache_mode)
        store = make_kv_store(quant, engine.spec, artifact)
        prompt = args.prompt_ids if args.prompt_ids is not None else engine.encode_prompt(args.prompt, args.chat)
        report = engine.generate([prompt], params, [row_options], kv_store=store)
    except ValidationError as err:
        print(f"error: {describe_validation_error(err)}", file=sys.stderr)
        return 2
    except ArtifactMismatch as err:
        hint = f" (set by {FLAGS[err.field]})" if err.field in FLAGS else ""
        print(f"error: {artifact_flag(args)} does not fit: {err}{hint}", file=sys.stderr)
        return 2
    except (EngineInputError, KVQuantError) as err:
        print(f"error: {flag_message(str(err))}", file=sys.stderr)
        return 2
    row = report.rows[0]
    if args.json:
        print(report.model_dump_json())
    else:
        print(row.text if row.text is not None else ",".join(map(str, row.generated_ids)))
        print(one_line_report(row, report.timings))
        if report.kv is not None:
            kv = report.kv
            print(
                f"[kv={kv.config['method']}/{kv.config['bits']}b K bits nominal={kv.k_nominal_bits:.3f} "
                f"storage={kv.k_storage_bits:.3f} V bits nominal={kv.v_nominal_bits:.3f} "
                f"storage={kv.v_storage_bits:.3f} held={kv.bytes_held}B bf16={kv.bf16_bytes}B]"
            )
    return 0
