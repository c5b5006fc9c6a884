"""A small fake engine with the `service.engine.Engine` interface, for HTTP-shape tests of the server (STYLE.md
habit 3: the API depends on an engine interface). It decodes nothing: the response of a row is its prompt's
characters in reverse order followed by EOS, revealed block by block with a configurable delay per block.

Special prompt characters make it misbehave on purpose: ``!`` raises an ordinary error in the batch (the worker
must answer 500 and live on), ``#`` raises a `DeviceFault` (readiness must fail).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from service.engine.params import DecodeParams, RowOptions
from service.engine.protocol import CacheCost, Capabilities
from service.engine.report import DecodeReport, RowReport, Timings
from service.engine.response import cut_response
from service.engine.spec import ModelSpec
from service.runtime.loop import DeviceFault

ALPHABET = " abcdefghijklmnopqrstuvwxyz.,!?#ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
PAD, BOS, EOS, MASK = 0, 1, 2, 127
OFFSET = 3  # token id of ALPHABET[0]


class CharTokenizer:
    """One token per character of ALPHABET; BOS first; a two-line chat template."""

    eos_token, bos_token, pad_token, unk_token = "<eos>", "<bos>", "<pad>", None
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        ids = [OFFSET + ALPHABET.index(c) for c in text if c in ALPHABET]
        return {"input_ids": ([BOS] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i - OFFSET] for i in ids if OFFSET <= i < OFFSET + len(ALPHABET))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tokenizer_kwargs=None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt
                                                                              else "")
        return self(text)["input_ids"] if tokenize else text


class FakeEngine:
    """See the module docstring. ``block_delay_s`` is slept per committed block (per batch, not per row)."""

    #: Its passes are planned like a bidirectional family's (each runs whole, a piece of a split one included);
    #: it cannot be preempted (`FakeBatch.preemptible`).
    capabilities = Capabilities(likelihood=True, layer_split=True, preemption=False, plan_bounded=True,
                                cache_kind="reuse", prefix_cache="a fake bidirectional family's prompt K/V depend on "
                                "what follows it")

    def __init__(self, block_delay_s: float = 0.0, max_length: int = 512) -> None:
        self.block_delay_s = block_delay_s
        self.tokenizer = CharTokenizer()
        self.spec = ModelSpec(arch="llada", model_id="fake-llada", fingerprint="fa" * 32, num_layers=2,
                              num_heads=2, num_kv_heads=2, head_dim=8, vocab_size=128, mask_id=MASK,
                              eos_ids=(EOS,), pad_id=PAD, max_length=max_length)
        self.calls: list[int] = []  # rows of every iteration, in order
        self.prefix_cache = None  # a bidirectional family: the prefix cache is never read

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def likelihood(self, ids, mc_num, mc_batch_size, seed, top_k=0, cancelled=None):
        """The real estimator (`service.engine.likelihood`) over a tiny seeded bigram-free network."""
        from service.engine.likelihood import PromptLikelihood

        return PromptLikelihood(_tiny_lm(self.spec.vocab_size), MASK, ids, mc_num, mc_batch_size, seed, top_k,
                                cancelled)

    # ---- the running batch's interface: one block per iteration for every cohort ----------------------------------
    def batch(self) -> FakeBatch:
        return FakeBatch(self)

    def cohort(self, prompts, params: DecodeParams, rows=None, kv_store=None, on_block=None, cancelled=None,
               validated=False):
        return FakeCohort(prompts, params, on_block, cancelled, rows)

    def report(self, cohort: FakeCohort) -> DecodeReport:
        """Each row cut as the engine's report cuts it (`service.engine.response.cut_response` with the row's
        options): the server takes the report's ids, text and finish reason as they are."""
        report = _report(cohort.answers, cohort.params, time.monotonic() - cohort.t0, self.decode_text,
                         cohort.rows or [RowOptions()] * len(cohort.answers), self.spec.eos_ids)
        if cohort.was_cancelled:
            report.rows[0].finish_reason = "cancelled"
        return report

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """Each row's own store, as a bidirectional family's."""
        return CacheCost(store_bytes)


class FakeCohort:
    """One request in a :class:`FakeBatch`: its answer, the next block to commit, and its callbacks."""

    def __init__(self, prompts, params: DecodeParams, on_block, cancelled, rows=None) -> None:
        self.prompts, self.params, self.on_block, self.cancelled, self.rows = prompts, params, on_block, cancelled, rows
        self.answers = [_answer(p, params) for p in prompts]
        self.block, self.t0, self.was_cancelled = 0, time.monotonic(), False
        self.store = None

    @property
    def done(self) -> bool:
        if self.cancelled is not None and all(self.cancelled()):
            self.was_cancelled = True
        return self.was_cancelled or self.block >= self.params.gen_length // self.params.block_length


class FakeBatch:
    """The fake `RunningBatch`: each step commits one block of every cohort, sleeping ``block_delay_s`` once;
    the sizes of the steps go to the engine's ``calls``; no cohort fails alone (``failed`` stays empty)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.cohorts, self.forwards, self.rows = engine, [], 0, 0
        self._finished: list[FakeCohort] = []
        self.failed: list[tuple[FakeCohort, BaseException]] = []

    def join(self, cohort: FakeCohort) -> None:
        self.cohorts.append(cohort)

    def leave(self, cohort: FakeCohort) -> None:
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)

    def preemptible(self, cohort: FakeCohort) -> bool:
        return False

    def preempt(self, cohort: FakeCohort):
        raise ValueError("the fake batch preempts nothing")

    def resume(self, cohort: FakeCohort, call) -> None:
        raise ValueError("the fake batch preempts nothing")

    def passes(self, cohorts) -> list[FakePass]:
        """Start an iteration of ``cohorts`` (the caller's running set): finished ones leave (:meth:`run`
        returns them); one full pass per other cohort, shaped as `service.engine.decode.Pass` for the scheduler's
        plan (`service.runtime.scheduler.plan_forwards`)."""
        done = [c.done for c in cohorts]
        self._finished = [c for c, d in zip(cohorts, done) if d]
        for cohort in self._finished:
            self.leave(cohort)
        return [FakePass(c, "full", len(c.prompts[0]) + c.params.gen_length, range(len(c.prompts)))
                for c, d in zip(cohorts, done) if not d]

    def run(self, forwards) -> list[FakeCohort]:
        """Commit one block of every cohort of the planned forwards (one recorded call, one sleep)."""
        cohorts = [p.cohort for group in forwards for p in group]
        self.forwards = 1 if cohorts else 0
        if not cohorts:
            return self._finished
        self.engine.calls.append(len(cohorts))
        _check_faults([p for c in cohorts for p in c.prompts])
        time.sleep(self.engine.block_delay_s)
        for cohort in cohorts:
            size = cohort.params.block_length
            cohort.block += 1
            if cohort.on_block is not None:
                cohort.on_block(cohort.block - 1, [a[: cohort.block * size] for a in cohort.answers])
        return self._finished

    def step(self) -> list[FakeCohort]:
        return self.run([self.passes(self.cohorts)])


@dataclass
class FakePass:
    """A fake cohort's next call: what the scheduler's plan reads of a pass."""

    cohort: FakeCohort
    kind: str
    width: int
    rows: range
    layers: tuple[int, int] | None = None  # the fake runs every pass whole, a piece of a split one included

    @property
    def seq_len(self) -> int:
        return self.width


def _check_faults(prompts) -> None:
    """``#`` in a prompt: a device fault; ``!``: an ordinary error (module docstring)."""
    if any(OFFSET + ALPHABET.index("#") in p for p in prompts):
        raise DeviceFault("CUDA error: an illegal memory access was encountered (injected)")
    if any(OFFSET + ALPHABET.index("!") in p for p in prompts):
        raise RuntimeError("injected fault in this batch")


def _answer(prompt, params: DecodeParams) -> list[int]:
    body = [t for t in reversed(prompt) if t >= OFFSET]
    return (body + [EOS] + [EOS] * params.gen_length)[: params.gen_length]


def _report(answers, params: DecodeParams, total_s: float, decode_text, rows, eos_ids) -> DecodeReport:
    num_blocks = params.gen_length // params.block_length
    reports = []
    for a, options in zip(answers, rows, strict=True):
        cut = cut_response(a, eos_ids, params.ignore_eos, options.max_tokens, options.stop, decode_text)
        reports.append(RowReport(generated_ids=cut.ids, text=cut.text, finish_reason=cut.finish_reason, nfe=num_blocks,
                                 steps_per_block=[1] * num_blocks, reveals_per_step=[params.block_length] *
                                 num_blocks, tokens_per_second=0.0))
    return DecodeReport(rows=reports, params=params, timings=Timings(total_s=total_s))


def _tiny_lm(vocab: int):
    """A seeded embedding whose logits are its rows' dot products: a torch module with ``embed``, ``config``,
    ``head=False`` and ``head_logits`` (what `service.engine.likelihood.PromptLikelihood` needs), the same
    weights every time."""
    from types import SimpleNamespace

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, 8)
            torch.nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(0))

        # mlp_cost: a dense gated MLP of hidden 24 (`ModelConfig.mlp_cost`), as admission reads it.
        config = SimpleNamespace(width=8, mlp_hidden=24, mlp_cost=(3 * 24, 3 * 8 * 24), num_heads=1, head_dim=8,
                                 vocab_size=vocab, num_layers=2)

        def forward(self, ids, head=True, layers=None, hidden=None):
            # Two "layers" that keep the embedding as it is: a forward split by layers (the server's plan of
            # likelihood work, `service.runtime.scheduler.likelihood_piece`; no parts of a layer here: it has no
            # `finish_layer`) gives the same values.
            start, stop = layers if layers is not None else (0, 2)
            hidden = self.embed(ids) if start == 0 else hidden
            return self.head_logits(hidden) if head and stop == 2 else hidden

        def head_logits(self, hidden):
            return hidden @ self.embed.weight.T

    return Tiny().eval()
