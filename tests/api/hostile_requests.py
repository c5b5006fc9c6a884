"""Fifty hostile or unusual requests against a running server, on every route, as a reviewer told nothing of the
server's rules would send them (issue 13, "Done when").

    python tests/api/hostile_requests.py http://127.0.0.1:8000 ADMIN_KEY SERVER_PID

Prints one line per request (status, seconds, what was sent) and a summary. Exits 1 when any request got a 5xx,
took longer than ``--slow-s`` (5 s; with ``--no-time-bar`` a slow request is reported, not failed: a loaded machine
is slow, not wrong), got a status of the wrong family (a hostile input accepted, a plain one refused) or an error
body that is not OpenAI's ``{"error": {message, type, param, code}}``; when the server's peak or current resident
memory (``/proc/<pid>/status`` VmHWM, VmRSS) went over 1 GB; or when ``/health/ready`` was not 200 (or not answered
within ``--ready-timeout-s``, 5 s) between two requests. Needs a served model with a tokenizer, a chat template and
a context of at least 4,096 tokens (the embedded model qualifies) and an admin key.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SLOW_S = 5.0  # the default of --slow-s and --ready-timeout-s
RSS_LIMIT_KB = 1_000_000  # 1 GB in /proc's kB (KiB)
OK, CLIENT_ERROR = "2xx", "4xx"


@dataclass
class Case:
    """One request and the status family a correct server answers it with."""

    name: str
    method: str
    path: str
    expect: str
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    admin: bool = False


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    """A short chat completion body with ``extra`` fields."""
    return {"model": "embedded", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def completion(prompt: Any = "hi", **extra: Any) -> dict[str, Any]:
    """A short completion body with ``extra`` fields."""
    return {"model": "embedded", "prompt": prompt, "max_tokens": 8, **extra}


def cases(info: dict[str, Any]) -> list[Case]:
    """The single requests (the stream, the concurrent swap and the admin checks are sent separately)."""
    vocab, mask, ctx = info["vocab_size"], info["mask_token_id"], info["model_max_length"]
    deep = "[" * 50_000 + "]" * 50_000
    c, cc, t = "/v1/completions", "/v1/chat/completions", "/tokenize"
    return [
        Case("plain chat", "POST", cc, OK, chat()),
        Case("max_tokens 1e30", "POST", cc, CLIENT_ERROR, chat(max_tokens=10**30)),
        Case("max_tokens -1", "POST", cc, CLIENT_ERROR, chat(max_tokens=-1)),
        Case("max_tokens 1.5", "POST", cc, CLIENT_ERROR, chat(max_tokens=1.5)),
        Case("max_tokens '8' (string)", "POST", cc, CLIENT_ERROR, chat(max_tokens="8")),
        Case("temperature 1e308", "POST", cc, CLIENT_ERROR, chat(temperature=1e308)),
        Case("temperature NaN (bare JSON NaN)", "POST", cc, CLIENT_ERROR,
             content=json.dumps(chat(temperature=float("nan"))).encode()),
        Case("seed 2**64", "POST", cc, CLIENT_ERROR, chat(seed=2**64)),
        Case("steps 1e9, threshold null", "POST", cc, CLIENT_ERROR, chat(steps=10**9, threshold=None)),
        Case("block_length 0", "POST", cc, CLIENT_ERROR, chat(block_length=0)),
        Case("messages not a list", "POST", cc, CLIENT_ERROR, {"model": "embedded", "messages": "hi"}),
        Case("messages empty", "POST", cc, CLIENT_ERROR, {"model": "embedded", "messages": []}),
        Case("role 'tool'", "POST", cc, CLIENT_ERROR,
             {"model": "embedded", "messages": [{"role": "tool", "content": "x"}]}),
        # OpenAI requires a user message's content; only an assistant's may be null.
        Case("content null", "POST", cc, CLIENT_ERROR,
             {"model": "embedded", "messages": [{"role": "user", "content": None}], "max_tokens": 8}),
        Case("assistant content null", "POST", cc, OK,
             {"model": "embedded", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                                                {"role": "user", "content": "y"}], "max_tokens": 8}),
        Case("unicode: emoji, RTL, zero-width, NUL, controls", "POST", cc, OK,
             chat("\U0001f600 \u202eabc\u200b \x00\x01\x1b[31m \ufeff \uffff \U0010ffff")),
        Case("lone surrogate in a message", "POST", cc, CLIENT_ERROR,
             content=b'{"model":"embedded","messages":[{"role":"user","content":"a\\ud800b"}]}'),
        Case("lone surrogate prompt, /tokenize", "POST", t, CLIENT_ERROR, content=b'{"prompt":"\\udfff"}'),
        Case("invalid UTF-8 bytes in the body", "POST", cc, CLIENT_ERROR,
             content=b'{"model":"embedded","messages":[{"role":"user","content":"\xff\xfe"}]}'),
        Case("empty body", "POST", cc, CLIENT_ERROR, content=b""),
        Case("body 'null'", "POST", c, CLIENT_ERROR, content=b"null"),
        Case("not JSON, text/plain", "POST", c, CLIENT_ERROR, content=b"hello", headers={"content-type": "text/plain"}),
        Case("deeply nested JSON body (50k)", "POST", cc, CLIENT_ERROR, content=deep.encode()),
        Case("deeply nested metadata (50k)", "POST", cc, CLIENT_ERROR,
             content=b'{"model":"embedded","messages":[{"role":"user","content":"x"}],"metadata":' +
             deep.encode() + b"}"),
        Case("empty prompt string", "POST", c, CLIENT_ERROR, completion("")),
        Case("prompt near the context", "POST", c, OK, completion("a " * (ctx - 200), max_tokens=32)),
        Case("prompt above the context", "POST", c, CLIENT_ERROR, completion("a " * (ctx + 100))),
        Case("prompt + max_tokens over the context", "POST", c, CLIENT_ERROR,
             completion("a " * (ctx - 50), max_tokens=200)),
        Case("2,000 stop strings", "POST", cc, CLIENT_ERROR, chat(stop=[f"s{i}" for i in range(2000)])),
        Case("one 1 MB stop string", "POST", cc, CLIENT_ERROR, chat(stop="x" * 1_000_000)),
        Case("empty stop string", "POST", cc, CLIENT_ERROR, chat(stop=[""])),
        Case("kv_quant k_group_size 1e9", "POST", cc, CLIENT_ERROR,
             chat(kv_quant={"method": "kivi", "k_group_size": 10**9})),
        Case("kv_quant bits 3", "POST", cc, CLIENT_ERROR, chat(kv_quant={"method": "kivi", "bits": 3})),
        Case("kv_quant unknown method", "POST", cc, CLIENT_ERROR, chat(kv_quant={"method": "gptq"})),
        Case("kv_quant policy_file /dev/zero", "POST", cc, CLIENT_ERROR,
             chat(kv_quant={"method": "dllm_kvq", "policy_file": "/dev/zero"})),
        Case("kv_quant kivi 2-bit at the context's group size", "POST", cc, OK,
             chat(kv_quant={"method": "kivi", "bits": 2, "k_group_size": ctx})),
        Case("mask id in a token prompt", "POST", c, CLIENT_ERROR, completion([1, mask, 2])),
        Case("token id = vocabulary size", "POST", c, CLIENT_ERROR, completion([1, vocab])),
        Case("negative token id", "POST", "/generate", CLIENT_ERROR, {"prompt": [1, -1], "max_tokens": 8}),
        Case("two token prompts at once", "POST", c, OK, completion([[1, 2, 3], [7, 8]])),
        Case("n = 9 (over DLLM_MAX_N)", "POST", cc, CLIENT_ERROR, chat(n=9)),
        Case("logprobs over 20", "POST", c, CLIENT_ERROR, completion(logprobs=21)),
        Case("tools (served, issue 35)", "POST", cc, OK,
             chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="required",
                  max_tokens=64)),
        Case("forced tools, max_tokens 8: no call fits (issue 45)", "POST", cc, CLIENT_ERROR,
             chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="required")),
        Case("tools: 129 of them", "POST", cc, CLIENT_ERROR,
             chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)])),
        Case("/tokenize both prompt and messages", "POST", t, CLIENT_ERROR,
             {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
        Case("/detokenize ids past 2**63 and booleans", "POST", "/detokenize", CLIENT_ERROR,
             {"tokens": [2**64, True]}),
        Case("/detokenize the mask id and an id past the vocabulary", "POST", "/detokenize", CLIENT_ERROR,
             {"tokens": [mask, vocab + 5]}),
        Case("/generate unknown model", "POST", "/generate", CLIENT_ERROR, {"model": "gpt-4", "prompt": "hi"}),
        Case("GET a POST route", "GET", c, CLIENT_ERROR),
        Case("unknown route", "GET", "/v1/../../etc/passwd", CLIENT_ERROR),
    ]


def admin_cases(info: dict[str, Any], key: str) -> list[Case]:
    """Admin routes: a bad key, bad configurations and bad uploads (sent with the right key unless said)."""
    return [
        Case("admin: wrong key", "GET", "/admin/active", CLIENT_ERROR, headers={"authorization": "Bearer nope"}),
        Case("admin: 100 kB key", "PUT", "/admin/active/dual", CLIENT_ERROR, {"method": "none"},
             headers={"authorization": "Bearer " + "k" * 100_000}),
        Case("admin: unknown cache mode", "PUT", "/admin/active/turbo", CLIENT_ERROR, {"method": "none"}, admin=True),
        Case("admin: dllm_kvq naming a policy that is not stored", "PUT", "/admin/active/dual", CLIENT_ERROR,
             {"method": "dllm_kvq", "policy_id": "0" * 64}, admin=True),
        Case("admin: policy upload, not JSON", "POST", "/admin/policies", CLIENT_ERROR, content=b"\x00\xff garbage",
             admin=True),
        Case("admin: policy upload, wrong fields", "POST", "/admin/policies", CLIENT_ERROR,
             {"layers": [{"p": -1}] * 3, "bits": 3}, admin=True),
        Case("admin: policy upload, 8 MB", "POST", "/admin/policies", CLIENT_ERROR,
             {"model_id": "x" * 8_000_000}, admin=True),
        Case("admin: state upload, random bytes", "POST", "/admin/kvquant_states", CLIENT_ERROR,
             content=bytes(range(256)) * 64, admin=True),
        Case("admin: traversal in an artifact id", "GET", "/admin/policies/..%2F..%2Fetc%2Fpasswd", CLIENT_ERROR,
             admin=True),
        Case("admin: audit limit 1e9", "GET", "/admin/audit?limit=1000000000", CLIENT_ERROR, admin=True),
    ]


class Reviewer:
    """Sends the cases, times them, watches memory and readiness, and keeps the failures."""

    def __init__(self, url: str, admin_key: str, pid: int, slow_s: float = SLOW_S, time_bar: bool = True,
                 ready_timeout_s: float = SLOW_S) -> None:
        self.url = url.rstrip("/")
        self.slow_s, self.time_bar, self.ready_timeout_s = slow_s, time_bar, ready_timeout_s
        self.slow: list[str] = []
        self.admin_key = admin_key
        self.status_path = Path(f"/proc/{pid}/status")
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.failures: list[str] = []
        self.sent = 0
        self.peak_kb = 0

    def fail(self, why: str) -> None:
        self.failures.append(why)
        print(f"    FAIL {why}", flush=True)

    def judge(self, name: str, expect: str, status: int, seconds: float, body: bytes | None) -> None:
        """Print the line and record what is wrong with the answer."""
        self.sent += 1
        print(f"{self.sent:3d} {status} {seconds:6.2f}s  {name}", flush=True)
        if status >= 500:
            self.fail(f"{name}: server error {status}: {(body or b'')[:300]!r}")
        elif f"{status // 100}xx" != expect:
            self.fail(f"{name}: {status}, expected {expect}: {(body or b'')[:300]!r}")
        elif status >= 400 and body is not None and not _openai_error(body):
            self.fail(f"{name}: {status} without an OpenAI error body: {body[:300]!r}")
        if seconds > self.slow_s and self.time_bar:
            self.fail(f"{name}: took {seconds:.2f} s (limit {self.slow_s:g} s)")
        elif seconds > self.slow_s:
            self.slow.append(f"{name}: {seconds:.2f} s")
            print(f"    SLOW over {self.slow_s:g} s (reported, not a failure: --no-time-bar)", flush=True)

    def send(self, case: Case) -> None:
        headers = dict(case.headers)
        if case.admin:
            headers["authorization"] = f"Bearer {self.admin_key}"
        if case.content is not None:
            headers.setdefault("content-type", "application/json")
        start = time.monotonic()
        try:
            r = self.http.request(case.method, case.path, json=case.json if case.content is None else None,
                                  content=case.content, headers=headers)
        except httpx.HTTPError as exc:
            self.sent += 1
            self.fail(f"{case.name}: no answer ({type(exc).__name__}: {exc})")
            return
        self.judge(case.name, case.expect, r.status_code, time.monotonic() - start, r.content)
        self.between()

    def between(self) -> None:
        """Between two requests: the server is ready and under the memory limit."""
        try:
            ready = self.http.get("/health/ready", timeout=self.ready_timeout_s).status_code
        except httpx.HTTPError as exc:
            ready = f"unreachable ({exc})"
        if ready != 200:
            self.fail(f"/health/ready answered {ready} after request {self.sent}")
        memory = _memory_kb(self.status_path)
        if memory is None:
            self.fail(f"server process gone ({self.status_path} unreadable) after request {self.sent}")
            return
        self.peak_kb = max(self.peak_kb, *memory.values())
        if max(memory.values()) > RSS_LIMIT_KB:
            self.fail(f"server memory {memory} kB over {RSS_LIMIT_KB} kB after request {self.sent}")

    def stream_and_disconnect(self) -> None:
        """A streamed chat whose client hangs up after the first chunk."""
        name = "stream, disconnect after the first chunk"
        start = time.monotonic()
        with self.http.stream("POST", "/v1/chat/completions",
                              json=chat("count to fifty", max_tokens=256, stream=True)) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
        self.judge(name, OK, status, time.monotonic() - start, None)
        self.between()

    def swap_while_serving(self) -> None:
        """Six chat requests in flight while the admin routes swap the dual mode's configuration three times."""
        swaps = [{"method": "kivi", "bits": 2, "k_group_size": 16}, {"method": "kivi", "bits": 8}, {"method": "none"}]

        def one(kind: str, body: dict[str, Any]) -> tuple[str, int, float, bytes]:
            start = time.monotonic()
            if kind == "chat":
                r = self.http.post("/v1/chat/completions", json=body)
            else:
                time.sleep(0.05)  # land while the chats are queued or decoding
                r = self.http.put("/admin/active/dual", json=body,
                                  headers={"authorization": f"Bearer {self.admin_key}"})
            return kind, r.status_code, time.monotonic() - start, r.content

        jobs = [("chat", chat(f"tell me about {i}", cache_mode="dual", max_tokens=16)) for i in range(6)]
        jobs += [("swap", s) for s in swaps]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(one, *job) for job in jobs]
            for job, future in zip(jobs, futures, strict=True):
                try:
                    kind, status, seconds, body = future.result()
                except httpx.HTTPError as exc:
                    self.sent += 1
                    self.fail(f"concurrent {job[0]}: no answer ({exc})")
                    continue
                self.judge(f"concurrent {kind} during config swaps", OK, status, seconds, body)
        self.between()

    def run(self) -> int:
        info = self.http.get("/tokenizer_info").json()
        start = time.monotonic()
        for case in cases(info):
            self.send(case)
        self.stream_and_disconnect()
        self.swap_while_serving()
        for case in admin_cases(info, self.admin_key):
            self.send(case)
        print(f"\n{self.sent} requests in {time.monotonic() - start:.1f} s; server peak memory "
              f"{self.peak_kb / 1e6:.2f} GB; {len(self.failures)} failures", flush=True)
        if self.slow:
            print(f"{len(self.slow)} over {self.slow_s:g} s, not judged (--no-time-bar): " + "; ".join(self.slow))
        for why in self.failures:
            print(f"  - {why}")
        return 1 if self.failures else 0


def _openai_error(body: bytes) -> bool:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


def _memory_kb(status_path: Path) -> dict[str, int] | None:
    """VmHWM and VmRSS of the server in kB, or None when the process is gone."""
    try:
        lines = status_path.read_text().splitlines()
    except OSError:
        return None
    return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines) if k in ("VmHWM", "VmRSS")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("admin_key", help="the server's admin key")
    parser.add_argument("pid", type=int, help="the server's process id (its memory is read from /proc)")
    parser.add_argument("--slow-s", type=float, default=SLOW_S, help="a request over this many seconds fails")
    parser.add_argument("--no-time-bar", action="store_true",
                        help="report requests over --slow-s but do not fail on them (a loaded or shared machine)")
    parser.add_argument("--ready-timeout-s", type=float, default=SLOW_S,
                        help="a /health/ready not answered within this many seconds fails")
    args = parser.parse_args(argv)
    return Reviewer(args.url, args.admin_key, args.pid, args.slow_s, not args.no_time_bar,
                    args.ready_timeout_s).run()


if __name__ == "__main__":
    sys.exit(main())
