"""Ask the running server questions from the embedded model's held-out test split with the official ``openai``
client: chat completions, streamed chat completions and plain completions (the chat template rendered on the
client with the model's own tokenizer), then the same questions once per cache mode for tokens/s (the dual cache twice: unquantized, by the request's own
``kv_quant``, and with the server's active configuration).

Prints each answer, whether it is right (``evaluation.embedded_task.score``: exact match of the digits), the
configuration the server says it ran with (``kv_config``), and tokens/s per cache mode (completion tokens over
wall seconds, requests one after another). ``--json FILE`` also writes everything it printed as JSON.

Usage: ``.venv/bin/python examples/ask.py [--url http://127.0.0.1:8000] [--questions 8] [--json FILE]``. The
server's root URL, as ``examples/kv_metrics.py`` takes it (``/v1`` is added here for the client): ``--url``, else
``$DLLM_SERVER_URL``, else ``http://127.0.0.1:8000``. A server that does not answer, or answers with an error, is
one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import openai
from openai import OpenAI

from evaluation.embedded_task import GEN_LENGTH, load_split, score
from service.engine.loading import load_tokenizer

EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "service" / "assets" / "embedded"
#: The server's root URL when no flag gives one (shared with ``examples/kv_metrics.py``).
SERVER_URL = os.environ.get("DLLM_SERVER_URL", "http://127.0.0.1:8000").rstrip("/")


def _record(kind: str, question, text: str, finish: str | None, usage, kv_config) -> dict:
    right = score(text, question.answer)
    print(f"[{kind:<11}] {question.id:<8} {'right' if right else 'wrong'}  {text.strip()[:60]!r}")
    return {"kind": kind, "id": question.id, "text": text, "right": right, "finish_reason": finish,
            "completion_tokens": usage.completion_tokens if usage else None, "kv_config": kv_config}


def _describe(kv_config: dict | None) -> str:
    """``dllm_kvq 2-bit policy-...`` from a response's ``kv_config`` (the snapshot the request ran with)."""
    quant = (kv_config or {}).get("kv_quant") or {}
    method = quant.get("method", "none")
    if method == "none":
        return "unquantized"
    artifact = quant.get("policy_id") or quant.get("kvquant_state_id") or ""
    return f"{method} {quant.get('bits')}-bit {artifact}".strip()


def main(argv: list[str] | None = None) -> dict:
    """Run the questions; returns (and with ``--json`` writes) what was printed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=SERVER_URL,
                    help="the server's root URL (default: $DLLM_SERVER_URL, else %(default)s)")
    ap.add_argument("--api-key", default="unused", help="a key from DLLM_API_KEYS when the server has any")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--questions", type=int, default=8, help="held-out test questions to ask (from the first)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    # The client's base URL is the root's /v1 (a root given with /v1 already is taken as it is).
    root = args.url.rstrip("/").removesuffix("/v1")
    client = OpenAI(base_url=root + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    questions = load_split("test")[: args.questions]
    out: dict = {"answers": [], "tokens_per_s": {}}

    for q in questions:  # chat completions: the server applies the chat template
        r = client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": q.prompt}],
                                           max_tokens=GEN_LENGTH)
        out["answers"].append(_record("chat", q, r.choices[0].message.content or "", r.choices[0].finish_reason,
                                      r.usage, getattr(r, "kv_config", None)))

    # Streamed: one chunk per committed block, the finish_reason, then (asked for, as OpenAI does) a last chunk with
    # the usage and no choices, then [DONE].
    q = questions[0]
    deltas, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": q.prompt}],
                                                max_tokens=GEN_LENGTH, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    print(f"[stream     ] {len(deltas)} chunks: {deltas}")
    out["answers"].append(_record("chat-stream", q, "".join(deltas), finish, usage, None))

    # The engine's own loader: AutoTokenizer would read config.json, whose model type (llada) transformers does not
    # know, and warn about it.
    tokenizer = load_tokenizer(EMBEDDED_DIR)
    q = questions[-1]  # plain completions: the prompt is the rendered chat template, as the model was trained
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": q.prompt}], tokenize=False,
                                           add_generation_prompt=True)
    r = client.completions.create(model=args.model, prompt=prompt, max_tokens=GEN_LENGTH)
    out["answers"].append(_record("completion", q, r.choices[0].text, r.choices[0].finish_reason, r.usage,
                                  getattr(r, "kv_config", None)))

    # Per cache mode; the dual cache also once with the request's own unquantized configuration beside the active one.
    runs = {"none": {"cache_mode": "none"}, "prefix": {"cache_mode": "prefix"},
            "dual-unquantized": {"cache_mode": "dual", "kv_quant": {"method": "none"}}, "dual": {"cache_mode": "dual"}}
    for mode, extra in runs.items():
        tokens, right, config = 0, 0, None
        started = time.perf_counter()
        for q in questions:
            r = client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": q.prompt}],
                                               max_tokens=GEN_LENGTH, extra_body=extra)
            tokens += r.usage.completion_tokens
            right += score(r.choices[0].message.content or "", q.answer)
            config = getattr(r, "kv_config", None)
        seconds = time.perf_counter() - started
        out["tokens_per_s"][mode] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                                     "right": right, "questions": len(questions), "kv_config": config}
        print(f"cache mode {mode:<16} {tokens / seconds:7.1f} tokens/s  {right}/{len(questions)} right  "
              f"(kv: {_describe(config)})")
    chat = [a for a in out["answers"] if a["kind"] == "chat"]
    print(f"chat answers right: {sum(a['right'] for a in chat)}/{len(chat)}, served with "
          f"{_describe(chat[0]['kv_config'])} ({chat[0]['kv_config'].get('source')} configuration)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def run(argv: list[str] | None = None) -> int:
    """`main` as a command: 0, or 2 with one line on stderr when the server cannot be reached or refuses."""
    try:
        main(argv)
    except openai.APIConnectionError as exc:
        print(f"error: cannot reach the server at {exc.request.url.copy_with(path='/')} ({exc.__cause__ or exc}); "
              "start it (.venv/bin/dllm-kvq serve) or give its root URL with --url or DLLM_SERVER_URL", file=sys.stderr)
        return 2
    except openai.APIStatusError as exc:
        print(f"error: {exc.request.url} answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
