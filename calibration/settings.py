"""The settings of a calibration run (:class:`JobSettings`), apart from the job so that the command line can list
them (flags, help, defaults) without importing torch."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from calibration.corpus import OFFLINE_CORPUS_DIR

#: The embedded default model's training split, its calibration corpus (issue 3); the path
#: `service.engine.loading.EMBEDDED_DIR` names, spelled here so that this module stays light.
EMBEDDED_TRAIN_SPLIT = Path(__file__).resolve().parents[1] / "service" / "assets" / "embedded" / "task" / "train_sample.jsonl"

#: The bit widths a fit accepts (a tuple field's ``choices``: its flag's choices, `calibration.cli.build_parser`).
BIT_CHOICES = [2, 4, 8]


class JobSettings(BaseModel):
    """Every setting of a calibration run (CLI flags map one to one: `calibration.cli.build_parser` makes a flag of
    each field from its type, default, description and ``choices``).

    Attributes:
        model: checkpoint dir or HF repo id; None = the embedded default model.
        buckets: bucket name -> JSONL path; empty = the embedded model's training split (``train_sample``) when
            ``model`` is None, else the shipped offline corpus (instruction, qa, code).
        pad_answers: EOS-pad answers up to a block multiple instead of cutting them; None = pad for the embedded
            model's training split (it was trained with answers EOS-padded to its response length), cut
            otherwise (the paper).
        samples: calibration samples drawn by ``mixed_chat``; seed: its seed.
        shard_index, shard_count: this run handles samples ``shard_index::shard_count`` (trace, diagnose, kvquant);
            fit and report always use every sample's sums.
        block_length, max_answer_length, steps_per_block, rounds: TRACE schedule and refinement limit.
        cache_modes, bits, k_group_size, v_group_size: what policies are fitted for (v_group_size None:
            min(32, head_dim)).
        bit_penalty, min_records, win_rate: fit gates (:class:`calibration.fit.FitSettings`).
        kvquant_bits, fisher, sparsity_threshold: KVQuant state fit.
        batch_size: rows per forward in TRACE's score matrix.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None
    buckets: dict[str, str] = Field(default_factory=dict)
    pad_answers: bool | None = None
    samples: int = Field(8, gt=0, description="calibration samples drawn from the buckets")
    seed: int = Field(0, description="seed of the sample draw")
    shard_index: int = Field(0, ge=0)
    shard_count: int = Field(1, gt=0)
    block_length: int = Field(32, gt=0, description="TRACE block length in tokens")
    max_answer_length: int = Field(64, gt=0, description="answers are cut (or padded) to at most this many tokens")
    steps_per_block: int = Field(8, ge=2, description="TRACE denoising steps per block")
    rounds: int = Field(3, gt=0, description="TRACE refinement round limit")
    cache_modes: tuple[str, ...] = Field(("prefix", "dual"), description="cache modes to fit policies for",
                                         json_schema_extra={"choices": ["prefix", "dual"]})
    bits: tuple[int, ...] = Field((4, 2), description="bit widths to fit dLLM-KVQ policies for",
                                  json_schema_extra={"choices": BIT_CHOICES})
    k_group_size: int = Field(32, gt=0, description="K tokens per quantization group")
    v_group_size: int | None = Field(None, description="V channels per group (default: min(32, head_dim))")
    bit_penalty: float = Field(0.01, ge=0, description="lambda: the fit objective's cost per nominal K bit above the target")
    min_records: int = Field(8, gt=0, description="fewest paired diagnostic records a candidate needs to be accepted")
    win_rate: float = Field(0.5, ge=0, le=1, description="least centered-score-distance win rate a candidate needs to be accepted")
    kvquant_bits: tuple[int, ...] = Field((4, 2), description="bit widths to fit KVQuant states for",
                                          json_schema_extra={"choices": BIT_CHOICES})
    fisher: bool = Field(False, description="weight KVQuant's k-means by Fisher information")
    sparsity_threshold: float = Field(0.99, gt=0, le=1, description="KVQuant: share of each vector kept dense (the rest are sparse outliers)")
    batch_size: int = Field(16, gt=0, description="rows per forward in TRACE's score matrix")

    @property
    def uses_embedded_split(self) -> bool:
        return self.model is None and not self.buckets

    def bucket_paths(self) -> dict[str, str]:
        if self.buckets:
            return dict(self.buckets)
        if self.uses_embedded_split:
            return {"train": str(EMBEDDED_TRAIN_SPLIT)}
        return {name: str(OFFLINE_CORPUS_DIR / f"{name}.jsonl") for name in ("instruction", "qa", "code")}

    @property
    def pads_answers(self) -> bool:
        return self.uses_embedded_split if self.pad_answers is None else self.pad_answers
