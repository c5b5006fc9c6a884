"""Load a public LLaDA or Dream checkpoint as published, without ``trust_remote_code``.

Formats (golden SPEC 1.1-1.2, 2.1-2.2): ``config.json`` + ``model.safetensors`` or sharded safetensors with
``model.safetensors.index.json``; from a local directory or a Hugging Face repo id already in the local cache
(``HF_HOME``; never downloads). The architecture comes from ``model_type``/``architectures``.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from service.engine.errors import EngineInputError
from service.engine.models import MODEL_CLASSES, DiffusionLM
from service.engine.spec import ModelSpec

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "assets" / "embedded"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# End-of-turn tokens that end a response besides the config's EOS (LLaDA-Instruct, Qwen2-style chat templates).
_END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"|"fp32"|"bfloat16"|"bf16"|"float16"|"fp16"`` (or a torch dtype among those) -> torch dtype.

    Raises:
        EngineInputError: any other value.
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise EngineInputError(f"unknown dtype {dtype!r}; legal: {', '.join(DTYPES)}")


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` -> torch device (CUDA only when available).

    Raises:
        EngineInputError: another device type, or CUDA asked for but not available.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise EngineInputError(f"unknown device {device!r}; legal: cpu, cuda, cuda:N") from err
    if resolved.type not in ("cpu", "cuda"):
        raise EngineInputError(f"unsupported device {device!r}; legal: cpu, cuda, cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EngineInputError(f"device {device!r} asked for but CUDA is not available here; use cpu")
    return resolved


def resolve_checkpoint_dir(model: str | Path | None) -> Path:
    """A local directory, a repo id in the local Hugging Face cache, or None for the embedded default.

    Raises:
        EngineInputError: nothing loadable under that name (message says where it looked).
    """
    if model is None:
        if not (EMBEDDED_DIR / "config.json").is_file():
            raise EngineInputError(
                f"the embedded default model is not in this install yet ({EMBEDDED_DIR} has no config.json); "
                "pass a checkpoint directory or a Hugging Face repo id"
            )
        return EMBEDDED_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineInputError(f"{path} is a directory without config.json; not a checkpoint")
        return path
    name = str(model)
    if path.exists():
        raise EngineInputError(f"{name} is a file; a checkpoint is a directory with config.json and safetensors")
    if path.is_absolute() or name.startswith((".", "~")) or name.count("/") != 1:
        # A path (a repo id is "org/name", never absolute nor relative to "."): say that it is missing, not that
        # a hub cache lacks it.
        raise EngineInputError(f"no checkpoint at {name}: {path.resolve()} does not exist; pass a checkpoint "
                               "directory (config.json + safetensors) or an 'org/name' repo id in the Hugging Face "
                               "cache")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as err:
        raise EngineInputError(
            f"{name!r} is not in the local Hugging Face cache (HF_HOME) and the server never downloads; "
            f"download it first (`hf download {name}`) or pass a local checkpoint directory"
        ) from err


def _shard_names(directory: Path) -> tuple[list[str], Path | None]:
    """The safetensors files of a checkpoint and its index file (None for a single ``model.safetensors``).

    Raises:
        EngineInputError: neither file exists, or a listed shard is missing.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        return ["model.safetensors"], None
    else:
        raise EngineInputError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    for shard in shards:
        if not (directory / shard).is_file():
            raise EngineInputError(f"shard {shard} listed in {index} is missing")
    return shards, index


def read_checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``.

    Raises:
        EngineInputError: neither file exists, or a listed shard is missing.
    """
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shard_names(directory)[0]:
        with safe_open(directory / shard, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                tensors[name] = handle.get_tensor(name)
    return tensors


def _hash_tensor(digest: Any, name: str, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().to("cpu").contiguous()
    digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def weights_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 over every tensor's name, shape, dtype and bytes, in name order.

    Two checkpoints with the same shapes but different values (a retrained model) get different fingerprints; the
    same weights in another shard layout get the same one.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        _hash_tensor(digest, name, tensors[name])
    return digest.hexdigest()


def checkpoint_fingerprint(directory: Path) -> str:
    """`weights_fingerprint` of a checkpoint folder, reading one tensor at a time (memory: the largest tensor, not
    the checkpoint: an 8B model's spec without 16 GB of weights in memory).

    Raises:
        EngineInputError: no safetensors weights there (see `read_checkpoint_tensors`).
    """
    with ExitStack() as stack:
        where = {}
        for shard in _shard_names(directory)[0]:
            handle = stack.enter_context(safe_open(directory / shard, framework="pt"))
            where.update(dict.fromkeys(handle.keys(), handle))
        digest = hashlib.sha256()
        for name in sorted(where):
            _hash_tensor(digest, name, where[name].get_tensor(name))
    return digest.hexdigest()


def detect_arch(hf_config: dict[str, Any]) -> str:
    """The family (a key of `MODEL_CLASSES`: ``"llada"``, ``"dream"``, ``"llada2"``) from ``model_type`` /
    ``architectures``.

    The longest family name found wins, so ``llada2_moe`` / ``LLaDA2MoeModelLM`` (and the 2.1 copy's
    ``llada21_moe``) are LLaDA2, never LLaDA.

    Raises:
        EngineInputError: any other model type.
    """
    names = [str(hf_config.get("model_type", ""))] + [str(a) for a in hf_config.get("architectures") or []]
    lowered = " ".join(names).lower()
    for arch in sorted(MODEL_CLASSES, key=len, reverse=True):
        if arch in lowered:
            return arch
    raise EngineInputError(f"unsupported model type {names}; legal: a model_type or architecture naming one of "
                           f"{', '.join(MODEL_CLASSES)} (e.g. 'llada', 'Dream', 'llada2_moe')")


def load_tokenizer(directory: Path):
    """The checkpoint's tokenizer through transformers (4.45+ or 5), never running remote code; None when the
    checkpoint ships no tokenizer files.

    A ``tokenizer_class`` of ``tokenizer_config.json`` that transformers itself provides (LLaDA and the embedded
    model: ``PreTrainedTokenizerFast``) is loaded with that class: ``AutoTokenizer`` would read ``config.json``
    too, and transformers 5 warns about its model type (``llada``, unknown to it) and ``auto_map`` entries that the
    engine never uses. Otherwise ``AutoTokenizer`` without remote code; a repo whose tokenizer class is remote code
    (Dream) falls back to ``PreTrainedTokenizerFast`` over its ``tokenizer.json`` with the special tokens of
    ``tokenizer_config.json``.
    """
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    import transformers
    from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    named = getattr(transformers, str(config.get("tokenizer_class")), None) if "auto_map" not in config else None
    if isinstance(named, type) and issubclass(named, PreTrainedTokenizerBase):
        try:
            return named.from_pretrained(directory, trust_remote_code=False)
        except (ValueError, OSError, KeyError):
            pass  # the class does not take these files: let AutoTokenizer choose
    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except (ValueError, OSError, KeyError):
        if not (directory / "tokenizer.json").is_file():
            raise
        special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        return PreTrainedTokenizerFast(
            tokenizer_file=str(directory / "tokenizer.json"), chat_template=config.get("chat_template"), **special
        )


@dataclass
class LoadedCheckpoint:
    """A model ready for inference (eval mode, no grad), its spec and tokenizer (or None)."""

    model: DiffusionLM
    spec: ModelSpec
    tokenizer: Any
    directory: Path


def _eos_ids(directory: Path, config_eos: int, tokenizer) -> tuple[int, ...]:
    ids = [config_eos]
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        ids += [vocab[token] for token in _END_OF_TURN_TOKENS if token in vocab]
    return tuple(dict.fromkeys(int(i) for i in ids))


def _config_of(directory: Path) -> tuple[type[DiffusionLM], Any]:
    """The model class and its config from ``config.json`` (EngineInputError naming the file when it does not fit)."""
    hf_config = json.loads((directory / "config.json").read_text())
    cls = MODEL_CLASSES[detect_arch(hf_config)]
    try:
        return cls, cls.config_from_hf(hf_config)
    except (KeyError, ValueError) as err:
        raise EngineInputError(f"{directory}/config.json: {err}") from err


def checkpoint_config(model: str | Path | None) -> tuple[type[DiffusionLM], Any, Path]:
    """The model class, its parsed config and the checkpoint's directory, from ``config.json`` alone (no weights
    read): what a start-up check of the server's settings against the checkpoint reads.

    Raises:
        EngineInputError: no checkpoint there, or an unsupported or malformed config.
    """
    directory = resolve_checkpoint_dir(model)
    return (*_config_of(directory), directory)


def model_class(model: str | Path | None) -> type[DiffusionLM]:
    """The model class (family) of a checkpoint, from its ``config.json`` alone (no weights read).

    Raises:
        EngineInputError: no checkpoint there, or an unsupported or malformed config.
    """
    return _config_of(resolve_checkpoint_dir(model))[0]


def _spec(model: str | Path | None, directory: Path, config: Any, fingerprint: str, tokenizer: Any) -> ModelSpec:
    if config.pad_id == config.mask_id:
        raise EngineInputError(f"{directory}: pad id equals the mask id ({config.mask_id}); padding would be decoded")
    return ModelSpec(
        arch=config.arch,
        model_id=str(model) if model is not None else "embedded",
        fingerprint=fingerprint,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        mask_id=config.mask_id,
        eos_ids=_eos_ids(directory, config.eos_id, tokenizer),
        pad_id=config.pad_id,
        max_length=config.max_length,
        tokenizer_size=len(tokenizer) if tokenizer is not None else None,
        canvas_length=getattr(config, "canvas_length", None),
    )


def checkpoint_spec(model: str | Path | None) -> ModelSpec:
    """The :class:`ModelSpec` `load_checkpoint` would give, without building the model (what checking a policy
    against a model needs: ``dllm-kvq policies activate`` over a store).

    Raises:
        EngineInputError: as `load_checkpoint`, but nothing about dtype or device.
    """
    directory = resolve_checkpoint_dir(model)
    _, config = _config_of(directory)
    return _spec(model, directory, config, checkpoint_fingerprint(directory), load_tokenizer(directory))


def load_checkpoint(
    model: str | Path | None, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Load config, weights (cast to ``dtype``, on ``device``) and tokenizer; build the :class:`ModelSpec`.

    Raises:
        EngineInputError: unknown dtype/device, no checkpoint, unsupported architecture, or weights that do not
            match the config (message names the tensors).
    """
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    directory = resolve_checkpoint_dir(model)
    cls, config = _config_of(directory)
    tensors = read_checkpoint_tensors(directory)
    fingerprint = weights_fingerprint(tensors)
    with torch.device("meta"):
        net = cls(config)
    try:
        net.load_checkpoint_tensors({k: v.to(device=torch_device, dtype=torch_dtype) for k, v in tensors.items()})
    except ValueError as err:
        raise EngineInputError(f"{directory}: {err}") from err
    net.eval().requires_grad_(False)
    tokenizer = load_tokenizer(directory)
    spec = _spec(model, directory, config, fingerprint, tokenizer)
    return LoadedCheckpoint(model=net, spec=spec, tokenizer=tokenizer, directory=directory)
