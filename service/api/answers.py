"""Answers: the results of a plan's jobs as the non-streamed OpenAI and native responses (choices, usage,
log-probabilities, tool calls read from the text), and the cut a response so far gets (:meth:`Answers.cut`,
which a stream applies to every committed block).

Every answer (completions, chat, ``/generate``, a stream's last chunk) takes the engine report's ids, text and
finish reason as they are (issue 34: a second cut of ids already cut lost the EOS that ``max_tokens`` removed, and
said ``length`` where the report said ``stop``); ``usage.completion_tokens`` counts the tokens returned.
"""

from __future__ import annotations

from typing import Any

from service.api import schemas as s
from service.api.logprobs import chat_logprobs, completion_logprobs
from service.api.planning import Plan
from service.api.tools import ToolAnswer, read_answer
from service.config import Settings
from service.engine.protocol import EngineLike
from service.engine.response import Cut, cut_response
from service.runtime.loop import Job, JobResult
from service.store.active import ActiveConfigs


class Answers:
    """Shapes results into answers (see the module docstring)."""

    def __init__(self, engine: EngineLike, active: ActiveConfigs, settings: Settings, model_name: str) -> None:
        self.engine, self.spec, self.model_name = engine, engine.spec, model_name
        self.active, self.settings = active, settings  # an echo-only answer names the default mode's snapshot

    def cut(self, job: Job, ids: list[int]) -> Cut:
        """The response so far of a job still decoding, from its committed ids (`service.engine.response.cut_response`,
        the rule the engine's report applies to the finished row; a finished row is never cut again)."""
        return cut_response(ids, self.spec.eos_ids, job.params.ignore_eos, job.row.max_tokens, job.row.stop,
                            self.engine.decode_text)

    def completion_response(self, plan: Plan, results: list[JobResult]) -> s.CompletionResponse:
        """The ``/v1/completions`` answer: one choice per prompt (and per ``n``), summed usage; with ``echo`` the
        prompt's text (and scores) before each choice's (an echo with ``max_tokens`` 0: the prompts alone)."""
        choices = []
        prompt_tokens = sum(len(p) for p in plan.prompts)  # once per prompt, whatever n (OpenAI's count)
        completion_tokens = 0
        tok = getattr(self.engine, "tokenizer", None)
        if not plan.jobs:  # echo with max_tokens 0
            for i, ids in enumerate(plan.prompts):
                logprobs = None
                if plan.logprobs is not None:
                    logprobs = completion_logprobs(tok, [], ids, plan.scored[i] if plan.scored else [])
                choices.append(s.CompletionChoice(index=i, text=plan.echo[i], logprobs=logprobs,
                                                  finish_reason="length", **_token_ids(plan, ids, [])))
        for k, (_job, row) in enumerate(_choice_rows(plan, results)):
            i = k // plan.n
            echo = plan.echo[i] if plan.echo is not None else ""
            logprobs = None
            if plan.logprobs is not None:
                scored = plan.scored[i] if plan.scored else None
                logprobs = completion_logprobs(tok, (row.logprobs or [])[:len(row.generated_ids)],
                                               plan.prompts[i] if scored is not None else None, scored,
                                               offset=0 if scored is not None else len(echo))
            choices.append(s.CompletionChoice(index=k, text=echo + (row.text or ""), logprobs=logprobs,
                                              finish_reason=row.finish_reason,
                                              **_token_ids(plan, plan.prompts[i], row.generated_ids)))
            completion_tokens += len(row.generated_ids)
        snapshot = results[0].snapshot if results else self.active.snapshot(self.settings.cache_mode)
        return s.CompletionResponse(
            id=plan.request_id, created=plan.created, model=self.model_name, choices=choices,
            usage=s.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens),
            kv_config=snapshot.describe(),
        )

    def chat_response(self, plan: Plan, results: list[JobResult]) -> s.ChatCompletionResponse:
        """The ``/v1/chat/completions`` answer (one choice per ``n``, summed usage)."""
        choices, completion_tokens = [], 0
        tok = getattr(self.engine, "tokenizer", None)
        for k, (_job, row) in enumerate(_choice_rows(plan, results)):
            logprobs = None
            if plan.logprobs is not None:
                logprobs = chat_logprobs(tok, (row.logprobs or [])[:len(row.generated_ids)])
            if plan.tools:
                answer = read_answer(row.text or "", row.finish_reason, forced=plan.tools_forced)
                message, reason = _tool_message(answer), answer.finish_reason
            else:
                message, reason = s.ChatMessageOut(content=row.text), row.finish_reason
            choices.append(s.ChatChoice(index=k, message=message, logprobs=logprobs, finish_reason=reason))
            completion_tokens += len(row.generated_ids)
        prompt_tokens = len(plan.jobs[0].prompt_ids)
        return s.ChatCompletionResponse(
            id=plan.request_id, created=plan.created, model=self.model_name, choices=choices,
            usage=s.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens),
            kv_config=results[0].snapshot.describe(),
        )

    def generate_response(self, plan: Plan, result: JobResult) -> s.GenerateResponse:
        """The ``/generate`` answer: the one-row report as the engine cut it, as the OpenAI routes answer it (the
        ids returned never exceed ``max_tokens``)."""
        report = result.report.model_copy(update={"rows": [result.row]})
        return s.GenerateResponse(
            **report.model_dump(), id=plan.request_id, model=self.model_name,
            prompt_tokens=len(plan.jobs[0].prompt_ids), kv_config=result.snapshot.describe(),
            queue_s=result.queue_s, batch_size=result.batch_size,
        )


def _tool_message(answer: ToolAnswer) -> s.ChatMessageOut:
    """The assistant message of a response read for calls."""
    calls = [s.ToolCallOut(id=i, function=s.FunctionCallOut(name=c.name, arguments=c.arguments))
             for i, c in answer.calls]
    return s.ChatMessageOut(content=answer.content, tool_calls=calls or None)


def _token_ids(plan: Plan, prompt: list[int], returned: list[int]) -> dict[str, list[int] | None]:
    """A completion choice's ``prompt_token_ids`` and ``token_ids`` (vLLM's ``return_token_ids`` fields) when the
    plan carries them, else none (they stay null)."""
    return {"prompt_token_ids": list(prompt), "token_ids": list(returned)} if plan.token_ids else {}


def _choice_rows(plan: Plan, results: list[JobResult]) -> list[tuple[Job, Any]]:
    """(job, row report) of every choice in order: choice ``k`` is row ``k % n`` of job ``k // n``."""
    return [(job, row) for job, result in zip(plan.jobs, results, strict=True) for row in result.report.rows]

