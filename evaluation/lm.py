"""The in-process lm-eval model ``dllm-kvq``: lm-eval requests decoded by `service.engine.Engine` directly.

Registered with lm-eval under :data:`MODEL_NAME` when this module is imported (``python -m evaluation lm-eval``
imports it before handing the arguments to lm-eval's CLI)::

    python -m evaluation lm-eval --model dllm-kvq \\
        --model_args model=GSAI-ML/LLaDA-8B-Instruct,dtype=bfloat16,device=cuda,cache_mode=dual,method=kivi,bits=4 \\
        --tasks gsm8k --num_fewshot 5 --gen_kwargs max_gen_toks=256

- ``generate_until``: block diffusion with the model_args' cache mode, block length, threshold or steps and KV
  quantization. The response window is ``max_gen_toks`` rounded up to whole blocks, on a canvas model
  (DiffusionGemma) to whole canvases (`service.engine.params.decode_window`, the rule the server applies to
  ``max_tokens``), where
  ``max_gen_toks`` is the task's (or ``--gen_kwargs max_gen_toks=N``, which overrides it on both the in-process
  and the HTTP path) and otherwise the ``max_gen_toks`` model_arg. The text is cut at EOS (by the engine) and at
  the first of the request's ``until`` strings, which never appear in it. Requests may carry the server's
  extra decoding fields in their gen_kwargs (``cache_mode``, ``block_length``, ``threshold``, ``steps``,
  ``kv_quant``), so one ``--gen_kwargs`` works for both paths.
- ``loglikelihood`` / ``loglikelihood_rolling``: the Monte-Carlo masked estimate of `evaluation.likelihood`
  (``mc_num`` samples), so multiple-choice and perplexity tasks run too; one forward pass reuses no cache, so
  cache mode and KV quantization do not change likelihoods. On a block-causal model (LLaDA2) they raise
  `service.engine.errors.EngineInputError` (a ValueError), as the server answers them with a 400: its ELBO is not
  implemented. LLaDA2 takes cache_mode ``none`` or ``block`` (``prefix`` and ``dual``, the default, decode as
  ``block``).

Every finished generation is kept in :attr:`DllmKvqLM.records` (task, doc id, response token ids, text, NFE) and
every KV report in :attr:`DllmKvqLM.kv_reports`, for the result matrix (exact match and token agreement between
rows, effective bits).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import lm_eval.models  # noqa: F401 - see below
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from evaluation.artifacts import load_artifact
from evaluation.likelihood import greedy_check, mc_loglikelihood
from evaluation.model_args import EvalModelArgs
from service.engine import Engine
from service.engine.params import DecodeParams, DecodeSettings, RowOptions, decode_window, resolve
from service.engine.report import KVReport
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store

# lm-eval imports its built-in models (hf, local-completions, ...) only while its registry is empty; registering
# ours first would hide them, so `lm_eval.models` is imported above, before `register_model` runs.

log = logging.getLogger(__name__)

#: The name to pass as ``--model`` to lm-eval.
MODEL_NAME = "dllm-kvq"

#: gen_kwargs keys lm-eval tasks send that this model honours, and the decoding settings (the server's extra fields).
_DECODE_KEYS = tuple(DecodeSettings.model_fields)
_KNOWN_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "kv_quant", *_DECODE_KEYS}
#: Sampling knobs accepted only at their neutral value (block diffusion has no nucleus/top-k sampling here).
_NEUTRAL = {"top_p": 1.0, "top_k": 0, "num_beams": 1}


@dataclass(frozen=True)
class GenerationRecord:
    """One finished ``generate_until`` request.

    Attributes:
        task, doc_id: lm-eval's task name and document index (None outside a task run).
        prompt_sha: SHA-256 of the prompt token ids (identifies the request across runs).
        ids: response token ids as the engine returned them (cut after the first EOS).
        text: the text handed back to lm-eval (cut at the stop strings).
        nfe: forward passes of this row.
    """

    task: str | None
    doc_id: int | None
    prompt_sha: str
    ids: tuple[int, ...]
    text: str
    nfe: int


@dataclass
class _Plan:
    """One request ready for the engine: its prompt ids, decode settings and row options."""

    index: int
    prompt: list[int]
    params: DecodeParams
    kv_config: KVQuantConfig
    row: RowOptions


def _prompt_sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


@register_model(MODEL_NAME)
class DllmKvqLM(TemplateLM):
    """lm-eval model over an in-process `Engine` (module docstring; model_args in `EvalModelArgs`).

    Args:
        engine: an already loaded engine to reuse (the matrix runs many configurations on one model); when
            given, ``model``, ``dtype``, ``device`` and ``threads`` are ignored.
        **kwargs: model_args (see `EvalModelArgs`), plus what lm-eval adds (``batch_size``,
            ``max_batch_size``, ``device``).

    Raises:
        ValueError: unknown or illegal model_args (the message lists the legal ones); a policy or state that
            does not fit the model (`service.artifacts.base.ArtifactMismatch`).
    """

    backend = "causal"

    def __init__(self, engine: Engine | None = None, **kwargs: Any) -> None:
        super().__init__()
        kwargs.pop("max_batch_size", None)  # lm-eval passes it for "auto" batch sizes, which we do not offer
        if isinstance(kwargs.get("batch_size"), str):
            if not kwargs["batch_size"].isdigit():
                raise ValueError(f"batch_size must be a positive integer, got {kwargs['batch_size']!r}")
            kwargs["batch_size"] = int(kwargs["batch_size"])
        self.args = EvalModelArgs.parse({k: v for k, v in kwargs.items() if v is not None})
        a = self.args
        self.engine = engine if engine is not None else Engine.load(a.checkpoint, a.dtype, a.device, a.threads)
        self.spec = self.engine.spec
        self.tokenizer = self.engine.tokenizer
        self._device = self.engine.device
        self.records: list[GenerationRecord] = []
        self.kv_reports: list[KVReport] = []
        self._artifacts: dict[tuple[KVQuantConfig, str], Any] = {}
        self._chat_rendered: set[str] = set()
        self._artifacts_for(a.kv_config, a.cache_mode)  # load and validate the artifact now, not at the first batch
        # The model_args' block length is the default here, as the server's is: a canvas model ignores it.
        gen_length, block = decode_window(a.max_gen_toks, None, self.spec.canvas_length, a.block_length)
        self.base_params = DecodeParams(**{**a.decode_settings(), "gen_length": gen_length, "block_length": block})

    # ---- lm-eval plumbing -------------------------------------------------------------------------------------
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        """lm-eval's constructor path: ``--batch_size`` / ``--device`` arrive in ``additional_config``; a value
        also given in ``--model_args`` wins (lm-eval's base class would raise a duplicate-keyword TypeError)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes device "cuda:0" unless told otherwise; on a CPU host keep our default (cpu).
            log.warning("device %s is not available here; using cpu", extra.pop("device"))
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        """As `create_from_arg_obj`, from ``key=value,...``."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        """The model's first EOS id (lm-eval's end of text)."""
        return self.spec.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """Context token for an empty context: BOS, else EOS (lm-eval's convention)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """Longest prompt + response in tokens (the model's)."""
        return self.spec.max_length

    @property
    def tokenizer_name(self) -> str:
        """Identifies the tokenizer in lm-eval's request cache keys."""
        return str(self.spec.model_id).replace("/", "__")

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{self.spec.model_id} has no tokenizer files; lm-eval tasks need text in and out")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; text this model rendered with its chat template gets no extra specials."""
        self._need_tokenizer()
        if string in self._chat_rendered:
            add_special_tokens = False
        if add_special_tokens is None:
            return list(self.tokenizer(string)["input_ids"])
        return list(self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"])

    def tok_decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
        self._need_tokenizer()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template rendered as text (lm-eval ``--apply_chat_template``).

        Encoding that text without added special tokens gives the ids the server's chat endpoint builds from the
        same messages (HF ``apply_chat_template(tokenize=True)`` renders, then encodes the same way).
        """
        self._need_tokenizer()
        text = self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
        self._chat_rendered.add(text)
        return text

    # ---- KV quantization --------------------------------------------------------------------------------------
    def _artifacts_for(self, config: KVQuantConfig, cache_mode: str) -> Any:
        """The artifact ``config`` names (None if its method applies none), loaded once and checked against the
        model and ``cache_mode`` (a policy fitted for another cache mode is refused, as the server refuses it)."""
        if (config, cache_mode) not in self._artifacts:
            self._artifacts[config, cache_mode] = load_artifact(config, self.spec, self.args.store, cache_mode)
        return self._artifacts[config, cache_mode]

    def _new_kv_store(self, config: KVQuantConfig, cache_mode: str):
        """A fresh KV store for one engine batch; None = the engine's full-precision store."""
        if config.method == "none":
            return None
        return make_kv_store(config, self.spec, self._artifacts_for(config, cache_mode))

    # ---- generation -------------------------------------------------------------------------------------------
    def _plan(self, index: int, context: str, gen_kwargs: dict[str, Any]) -> _Plan:
        gen_kwargs = dict(gen_kwargs or {})
        for key, neutral in _NEUTRAL.items():
            value = gen_kwargs.pop(key, neutral)
            if value not in (neutral, None):
                raise ValueError(f"gen_kwargs {key}={value!r} is not supported (only {neutral}); "
                                 f"supported: {', '.join(sorted(_KNOWN_GEN_KWARGS))}")
        unknown = sorted(set(gen_kwargs) - _KNOWN_GEN_KWARGS)
        if unknown:
            raise ValueError(f"unsupported gen_kwargs {unknown}; supported: {', '.join(sorted(_KNOWN_GEN_KWARGS))}")
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        # A task's decoding settings, else the model_args', as a server request resolves against its defaults.
        overrides = DecodeSettings(**{k: gen_kwargs[k] for k in _DECODE_KEYS if k in gen_kwargs})
        given = {k: getattr(overrides, k) for k in overrides.model_fields_set}
        max_gen_toks = int(gen_kwargs.get("max_gen_toks") or self.args.max_gen_toks)
        # The server's rule (`decode_window`): a canvas model (DiffusionGemma) decodes whole canvases, and refuses a
        # task's block_length other than its canvas as the server's 400 does.
        gen_length, block = decode_window(max_gen_toks, given.get("block_length"), self.spec.canvas_length,
                                          self.args.block_length)
        params = resolve(given, self.args, gen_length).model_copy(update={"block_length": block})
        kv_config = self.args.kv_config
        if gen_kwargs.get("kv_quant") is not None:
            kv_config = KVQuantConfig(**gen_kwargs["kv_quant"])
        do_sample = bool(gen_kwargs.get("do_sample", False))
        temperature = float(gen_kwargs.get("temperature", 1.0 if do_sample else 0.0)) if do_sample else 0.0
        prompt = self.tok_encode(context)
        room = self.spec.max_length - params.gen_length
        if room < 1:
            raise ValueError(f"a response of {params.gen_length} tokens leaves no room for a prompt within the "
                             f"model's {self.spec.max_length} tokens; lower max_gen_toks")
        if len(prompt) > room:
            log.warning("prompt of %d tokens left-truncated to %d (max_length %d - response %d)",
                        len(prompt), room, self.spec.max_length, params.gen_length)
            prompt = prompt[-room:]
        row = RowOptions(temperature=temperature, seed=self.args.seed, stop=until, max_tokens=max_gen_toks)
        return _Plan(index, prompt, params, kv_config, row)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Decode every request (module docstring); batches group requests with equal decode settings."""
        plans = [self._plan(i, *req.args) for i, req in enumerate(requests)]
        groups: dict[tuple, list[_Plan]] = defaultdict(list)
        for plan in plans:
            groups[(plan.params, plan.kv_config)].append(plan)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="dllm-kvq generate", disable=disable_tqdm)
        size = self.args.batch_size
        for (params, kv_config), members in groups.items():
            for start in range(0, len(members), size):
                chunk = members[start:start + size]
                kv_store = self._new_kv_store(kv_config, params.cache_mode)
                report = self.engine.generate(
                    [p.prompt for p in chunk], params, rows=[p.row for p in chunk], kv_store=kv_store,
                )
                # The quantized store keeps its accounting after the engine clears it at the end of the decode.
                kv = report.kv if report.kv is not None else (kv_store.report() if kv_store is not None else None)
                if kv is not None:
                    self.kv_reports.append(kv)
                for plan, row in zip(chunk, report.rows, strict=True):
                    # cut at max_gen_toks, EOS and the first stop string by the engine, as the server cuts a response
                    text = row.text
                    req = requests[plan.index]
                    out[plan.index] = text
                    self.records.append(GenerationRecord(
                        req.task_name, req.doc_id, _prompt_sha(plan.prompt), tuple(row.generated_ids), text, row.nfe,
                    ))
                    self.cache_hook.add_partial("generate_until", req.args, text)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    # ---- likelihoods ------------------------------------------------------------------------------------------
    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.engine.model(ids)

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        # A block-causal model (LLaDA2) is refused as the server refuses it (400): the MC estimate below is the
        # bidirectional ELBO, not that model's likelihood.
        self.engine.check_likelihood()
        total = len(context) + len(continuation)
        if total > self.spec.max_length:
            keep = self.spec.max_length - len(continuation)
            if keep < 1:
                raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            context = context[-keep:]
        a = self.args
        logprob = mc_loglikelihood(self._logits, context, continuation, mask_id=self.spec.mask_id, mc_num=a.mc_num,
                                   mc_batch_size=a.mc_batch_size, seed=a.seed, device=self._device)
        greedy = a.check_greedy and greedy_check(self._logits, context, continuation, mask_id=self.spec.mask_id,
                                                 device=self._device)
        return logprob, bool(greedy)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        out = []
        for (args, context, continuation) in tqdm(requests, desc="dllm-kvq loglikelihood", disable=disable_tqdm):
            result = self._score(list(context), list(continuation))
            self.cache_hook.add_partial("loglikelihood", args, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """ELBO of each whole string given the prefix token (one window: strings must fit ``max_length - 1``).

        Raises:
            ValueError: a string longer than the model's context (rolling windows are not implemented); a
                block-causal model (`service.engine.errors.EngineInputError`: LLaDA2 has no likelihood yet).
        """
        out = []
        for req in tqdm(requests, desc="dllm-kvq loglikelihood_rolling", disable=disable_tqdm):
            (string,) = req.args
            tokens = self.tok_encode(string, add_special_tokens=False)
            if len(tokens) + 1 > self.spec.max_length:
                raise ValueError(f"text of {len(tokens)} tokens exceeds max_length - 1 = {self.max_length - 1}")
            logprob, _ = self._score([self.prefix_token_id], tokens)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, logprob)
            out.append(logprob)
        return out
