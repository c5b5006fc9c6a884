"""The client side of scripts/container_smoke.sh: what a user of the container sees, over HTTP with the openai client.

    python scripts/container_smoke_client.py ready URL --timeout S [--container-gone CMD...]
    python scripts/container_smoke_client.py serve URL --model NAME --api-key KEY --stop CMD...
    python scripts/container_smoke_client.py stack URL --model NAME --api-key KEY --admin-key KEY

Each command prints one line per check and exits 1 on the first failure, naming what was expected.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai


def fail(message: str) -> None:
    print(f"container_smoke: FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def say(message: str) -> None:
    print(f"container_smoke: {message}", file=sys.stderr, flush=True)


def http(method: str, url: str, body: object | None = None, key: str | None = None) -> tuple[int, object]:
    """(status, parsed JSON or text) of one request; connection errors propagate."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def ready(args: argparse.Namespace) -> None:
    """Poll GET /health/ready until 200; print the seconds it took. Fails when a container check says it died."""
    start = time.monotonic()
    while time.monotonic() - start < args.timeout:
        try:
            if http("GET", f"{args.url}/health/ready")[0] == 200:
                print(f"{time.monotonic() - start:.1f}")
                return
        except OSError:
            pass
        if args.alive and subprocess.run(args.alive, capture_output=True, check=False).returncode != 0:
            fail(f"the container stopped before it was ready ({' '.join(args.alive)} failed)")
        time.sleep(1.0)
    fail(f"{args.url}/health/ready did not answer 200 within {args.timeout} s")


def chat(client: openai.OpenAI, model: str) -> None:
    """One chat completion through the openai client, answered under the served name."""
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "next: 1 2 3"}],
                                           max_tokens=16)
    text = reply.choices[0].message.content
    if reply.model != model or not text:
        fail(f"chat completion: model {reply.model!r} (expected {model!r}), text {text!r}")
    say(f"chat completion as {model!r}: {reply.usage.completion_tokens} tokens, {text!r}")


def serve(args: argparse.Namespace) -> None:
    """Models list, a chat completion, then SIGTERM while a streamed completion is mid-way: it must finish whole."""
    listed = [m.id for m in openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key).models.list().data]
    if listed != [args.model]:
        fail(f"/v1/models lists {listed}, expected [{args.model!r}] (DLLM_SERVED_MODEL_NAME)")
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0)
    chat(client, args.model)
    # No cache, EOS ignored and one token revealed per step (steps = max_tokens): 8 blocks of 32 forwards each,
    # seconds on a CPU, so the stream is still running when SIGTERM arrives (checked below). With the default
    # threshold schedule the whole stream took 0.16 s on the embedded model, less than `podman kill` can take.
    max_tokens = 256
    stream = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "next: 1"}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "cache_mode": "none", "steps": max_tokens})
    chunks, finish, usage, stopper, signalled, last = 0, None, None, None, {}, 0.0

    def stop() -> None:
        subprocess.run(args.stop, check=True, capture_output=True)
        signalled["at"] = time.monotonic()  # the engine has delivered the signal

    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            last = time.monotonic()
            if stopper is None:  # the first block is out, the rest are not: the request is in flight
                stopper = threading.Thread(target=stop)
                stopper.start()
                say(f"SIGTERM sent mid-stream ({' '.join(args.stop)})")
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    if stopper is None:
        fail("the stream produced no content before it ended")
    stopper.join()
    if "at" not in signalled:
        fail(f"{' '.join(args.stop)} failed")
    if signalled["at"] > last:  # nothing was in flight when the signal landed: the check would prove nothing
        fail(f"the stream ended before SIGTERM was delivered; make it longer than {max_tokens} tokens")
    if finish != "length" or usage != max_tokens or chunks < 2:
        fail(f"the in-flight stream was cut by SIGTERM: finish {finish!r}, {usage} of {max_tokens} tokens, "
             f"{chunks} chunks")
    say(f"the in-flight stream finished after SIGTERM: {chunks} chunks, {usage} tokens, finish {finish!r}")


def stack(args: argparse.Namespace) -> None:
    """The compose stack: a chat completion, then an admin activation the api applies (through Redis)."""
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0)
    chat(client, args.model)
    wanted = {"method": "kivi", "bits": 4}
    status, body = http("PUT", f"{args.url}/admin/active/dual", wanted, args.admin_key)
    if status != 200:
        fail(f"PUT /admin/active/dual answered {status}: {body}")
    # ``old`` is the store's previous entry (null on a first activation); ``served_before`` what the api served.
    before = body["old"] or body.get("served_before") or {"method": "none"}
    say(f"activation: {before['method']} -> {body['new']['method']} {body['new'].get('bits')}-bit")
    status, body = http("POST", f"{args.url}/generate", {"prompt": "next: 1 2 3", "max_tokens": 8,
                                                        "cache_mode": "dual"}, args.api_key)
    if status != 200:
        fail(f"POST /generate after the activation answered {status}: {body}")
    applied = body["kv_config"]["kv_quant"]
    if applied.get("method") != "kivi" or applied.get("bits") != 4:
        fail(f"the api decoded with {applied} after activating {wanted}")
    say(f"the next request decoded with the activated configuration: {applied['method']} {applied['bits']}-bit")


def main() -> None:
    parser = argparse.ArgumentParser(prog="container_smoke_client.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ready")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--alive", nargs=argparse.REMAINDER, default=None, help="a command that fails once it died")
    for name in ("serve", "stack"):
        p = sub.add_parser(name)
        p.add_argument("url")
        p.add_argument("--model", required=True)
        p.add_argument("--api-key", required=True)
        if name == "serve":
            p.add_argument("--stop", nargs=argparse.REMAINDER, required=True, help="the command that sends SIGTERM")
        else:
            p.add_argument("--admin-key", required=True)
    args = parser.parse_args()
    {"ready": ready, "serve": serve, "stack": stack}[args.command](args)


if __name__ == "__main__":
    main()
