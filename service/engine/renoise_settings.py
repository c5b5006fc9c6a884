"""A DiffusionGemma request's renoising settings: the reference's defaults, the checkpoint's
``generation_config.json`` over them, the request's fields over both, checked as the reference checks them.

Its own module (not `service.engine.renoise`) so that the model's request check
(`service.engine.models.diffusion_gemma.RenoisingRule.check_request`) reads it without importing the decoder, which
imports the model.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from service.engine.errors import EngineInputError
from service.engine.params import RENOISING_FIELDS, DecodeParams

#: The reference's global defaults (``DiffusionGemmaGenerationConfig._get_default_generation_params``), applied
#: where neither the call nor the checkpoint's ``generation_config.json`` sets a value.
DEFAULTS = {"max_new_tokens": 256, "max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
            "stability_threshold": 1, "confidence_threshold": 0.005}


def generation_config(directory: Path | None) -> dict:
    """The checkpoint's ``generation_config.json`` (``{}``: none, or no directory), read once per version of the
    file (the server reads it for every request's defaults). Not to be modified."""
    path = directory / "generation_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    stat = path.stat()
    return _read_json(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _read_json(path: str, mtime_ns: int, size: int) -> dict:
    return json.loads(Path(path).read_text())


#: The temperatures the float32 schedule (`service.engine.renoise.temperature`, computed in float32 as the
#: reference computes it) can run: ``t_max`` at most :data:`T_MAX_CEILING` (the soft-capped logits, |x| <= 30 on
#: the public config, divided by it are already uniform to float32's precision; a float64 ``1e308`` is infinite in
#: float32 and gave NaN probabilities, a canvas of id 0), and the schedule's smallest temperature, at the last
#: step ``t_min + (t_max - t_min) / max_denoising_steps``, at least :data:`T_FLOOR` (a float32 ``1e-300`` is 0,
#: and the logits divided by it are infinite: NaN again). ``t_min`` is 0 or at least the floor.
T_MAX_CEILING = 1e4
T_FLOOR = 1e-6


@dataclass(frozen=True)
class RenoiseParams:
    """One request's renoising settings (the reference's ``generate`` arguments), checked as the reference checks
    them (``DiffusionGemmaGenerationConfig.validate``, ``EntropyBoundSamplerConfig``).

    Attributes:
        max_new_tokens: G; ``ceil(G / canvas_length)`` canvases at most (each whole: the reference returns them).
        max_denoising_steps: N > 0, decoder passes per canvas at most.
        entropy_bound: > 0 and finite, the accepted positions' summed entropy less the largest, in nats.
        t_min, t_max: the temperature schedule's ends, ``0 <= t_min < t_max <= 1e4`` (:data:`T_MAX_CEILING`), finite,
            ``t_min`` 0 or at least ``1e-6`` (:data:`T_FLOOR`), and so is the schedule's smallest temperature
            ``t_min + (t_max - t_min) / max_denoising_steps`` (float32 must hold them and the logits divided by them).
        stability_threshold: >= 0 steps the argmax must have been the same (0: no stability condition).
        confidence_threshold: > 0 and finite, mean entropy (nats) under which a stable canvas stops.

    Raises:
        EngineInputError: a value the reference refuses (the message names the field).
    """

    max_new_tokens: int = DEFAULTS["max_new_tokens"]
    max_denoising_steps: int = DEFAULTS["max_denoising_steps"]
    entropy_bound: float = DEFAULTS["entropy_bound"]
    t_min: float = DEFAULTS["t_min"]
    t_max: float = DEFAULTS["t_max"]
    stability_threshold: int = DEFAULTS["stability_threshold"]
    confidence_threshold: float = DEFAULTS["confidence_threshold"]

    def __post_init__(self) -> None:
        # Lazily ordered: a later check may divide by a value an earlier one bounds (the smallest temperature).
        checks = [
            ("max_new_tokens", lambda: self.max_new_tokens > 0, "a positive integer"),
            ("max_denoising_steps", lambda: self.max_denoising_steps > 0, "a positive integer"),
            ("entropy_bound", lambda: 0 < self.entropy_bound < math.inf, "a finite float > 0"),
            ("t_min", lambda: 0 <= self.t_min < math.inf, "a finite float >= 0"),
            ("t_max", lambda: self.t_max > self.t_min, f"> t_min ({self.t_min})"),
            ("t_max", lambda: self.t_max <= T_MAX_CEILING,
             (f"at most {T_MAX_CEILING:g} (float32 temperatures: above it the schedule overflows float32 or "
             "already draws uniformly)")),
            ("t_min", lambda: self.t_min == 0 or self.t_min >= T_FLOOR,
             f"0 or at least {T_FLOOR:g} (below it float32 holds 0 and the logits divided by it are infinite)"),
            ("t_max", lambda: self._smallest_temperature() >= T_FLOOR,
             (f"such that the schedule's smallest temperature, t_min + (t_max - t_min) / max_denoising_steps "
             f"(here {self._smallest_temperature():g}), is at least {T_FLOOR:g}; raise t_max (or t_min)")),
            ("stability_threshold", lambda: self.stability_threshold >= 0, "an integer >= 0"),
            ("confidence_threshold", lambda: 0 < self.confidence_threshold < math.inf, "a finite float > 0"),
        ]
        for name, ok, legal in checks:
            if not ok():
                raise EngineInputError(f"{name} must be {legal}, got {getattr(self, name)!r}", name)

    def _smallest_temperature(self) -> float:
        """The schedule's temperature at its last step (the step fraction ``1 / max_denoising_steps``)."""
        if self.max_denoising_steps <= 0:  # refused first; the message is built before the checks run
            return math.nan
        return self.t_min + (self.t_max - self.t_min) / self.max_denoising_steps

    @classmethod
    def for_checkpoint(cls, directory: Path | None, **given) -> RenoiseParams:
        """The settings of a call: ``given`` (None values dropped) over the checkpoint's ``generation_config.json``
        over :data:`DEFAULTS`, the reference's order of precedence (``_prepare_generation_config``)."""
        values = dict(DEFAULTS)
        saved = generation_config(directory)
        if saved:
            sampler = saved.get("sampler_config") or {}
            if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
                values["entropy_bound"] = sampler["entropy_bound"]
            values.update({k: saved[k] for k in DEFAULTS if saved.get(k) is not None})
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)


def stop_ids(directory: Path | None) -> tuple[tuple[int, ...], int | None]:
    """The EOS ids and the pad id the reference's ``generate`` uses: its generation config's, i.e. the checkpoint's
    ``generation_config.json`` (none there, or no such file: no EOS ends the text and nothing is padded; the
    reference does not fall back on ``config.json``)."""
    saved = generation_config(directory)
    eos = saved.get("eos_token_id")
    eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    pad = saved.get("pad_token_id")
    return eos_ids, int(pad) if pad is not None else None


def settings_for(params: DecodeParams, directory: Path | None) -> RenoiseParams:
    """The renoising settings of a request: ``max_new_tokens`` its decode window (``gen_length``), the renoising
    fields it (or the server) gives over the checkpoint's ``generation_config.json`` over the reference's defaults.

    Raises:
        EngineInputError: a value the reference refuses (``t_max`` not above ``t_min`` ...), naming the field.
    """
    return RenoiseParams.for_checkpoint(directory, max_new_tokens=params.gen_length,
                                        **{name: getattr(params, name) for name in RENOISING_FIELDS})


def checkpoint_directory(spec) -> Path | None:
    """The directory the model ``spec`` describes was loaded from (its ``generation_config.json`` holds the
    renoising defaults), or None (a repo id, the embedded model: the reference's defaults apply)."""
    directory = Path(spec.model_id)
    return directory if (directory / "config.json").is_file() else None
