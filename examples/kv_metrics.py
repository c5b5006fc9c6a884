"""Read the server's Prometheus metrics (``GET /metrics``, parsed with ``prometheus_client.parser``) and print what
the quantized cache costs and keeps: the active configuration per cache mode, effective bits (nominal and storage,
K and V) and bytes held against bf16 per configuration served, and the online agreement with the unquantized cache
(shadow re-decodes, ``--shadow-rate``).

Usage: ``.venv/bin/python examples/kv_metrics.py [--url http://127.0.0.1:8000] [--save FILE]`` (``--save``: the raw
text). The server's root URL, as ``examples/ask.py`` takes it: ``--url``, else ``$DLLM_SERVER_URL``, else
``http://127.0.0.1:8000``. A server that does not answer, or answers with an error, is one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

CONFIG_LABELS = ("method", "bits", "cache_mode", "policy")


def samples(text: str) -> dict[str, list]:
    """Metric samples by sample name (``dllm_kv_bytes_held``, ``dllm_shadow_token_agreement_sum`` ...)."""
    out: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append(s)
    return out


def _key(labels: dict) -> tuple:
    return tuple(labels.get(k, "") for k in CONFIG_LABELS)


def _name(key: tuple) -> str:
    method, bits, mode, policy = key
    if method == "none":
        return f"{mode:<6} unquantized"
    return f"{mode:<6} {method} {bits}-bit" + (f" {policy[:24]}" if policy else "")


def report(text: str) -> list[str]:
    """The printed lines for one scrape."""
    m = samples(text)
    lines = ["active configuration:"]
    for s in m["dllm_active_config_info"]:
        lines.append(f"  {_name(_key(s.labels)):<40} (from {s.labels['source']})")
    bits: dict[tuple, dict] = defaultdict(dict)
    for s in m["dllm_kv_effective_bits"]:
        bits[_key(s.labels)][f"{s.labels['tensor']}_{s.labels['accounting']}"] = s.value
    held = {_key(s.labels): s.value for s in m["dllm_kv_bytes_held"]}
    bf16 = {_key(s.labels): s.value for s in m["dllm_kv_bf16_bytes"]}
    lines.append("KV cache served (last batch per configuration):")
    for key in sorted(bits):
        b = bits[key]
        ratio = held.get(key, 0) / bf16[key] if bf16.get(key) else float("nan")
        lines.append(f"  {_name(key):<40} K {b.get('k_nominal', 0):.3f} / V {b.get('v_nominal', 0):.3f} nominal bits, "
                     f"K {b.get('k_storage', 0):.3f} / V {b.get('v_storage', 0):.3f} storage bits; "
                     f"{held.get(key, 0):,.0f} bytes held = {ratio:.3f} x bf16 ({bf16.get(key, 0):,.0f})")
    agreement_sum = {_key(s.labels): s.value for s in m["dllm_shadow_token_agreement_sum"]}
    agreement_n = {_key(s.labels): s.value for s in m["dllm_shadow_token_agreement_count"]}
    exact = {_key(s.labels): s.value for s in m["dllm_shadow_exact_match_total"]}
    lines.append("agreement with the unquantized cache (shadow re-decodes):")
    for key in sorted(agreement_n):
        n = agreement_n[key]
        if n:
            lines.append(f"  {_name(key):<40} {int(n)} re-decoded, token agreement {agreement_sum[key] / n:.3f}, "
                         f"exact match {exact.get(key, 0) / n:.3f}")
    tokens = sum(s.value for s in m["dllm_generation_tokens_total"])
    answered = sum(s.value for s in m["dllm_requests_total"] if s.labels.get("status") == "200")
    lines.append(f"requests answered 200: {answered:.0f}; generated tokens: {tokens:.0f}")
    return lines


def main(argv: list[str] | None = None) -> str:
    """Scrape, print, optionally save; returns the raw text."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("DLLM_SERVER_URL", "http://127.0.0.1:8000").rstrip("/"),
                    help="the server's root URL (default: $DLLM_SERVER_URL, else http://127.0.0.1:8000)")
    ap.add_argument("--save", type=Path, help="write the raw metrics text here")
    args = ap.parse_args(argv)
    root = args.url.rstrip("/").removesuffix("/v1")  # the root, also when given as the clients' /v1 URL
    text = httpx.get(f"{root}/metrics", timeout=30).raise_for_status().text
    if args.save:
        args.save.write_text(text)
    print("\n".join(report(text)))
    return text


def run(argv: list[str] | None = None) -> int:
    """`main` as a command: 0, or 2 with one line on stderr when the server cannot be reached or refuses."""
    try:
        main(argv)
    except httpx.HTTPStatusError as exc:
        print(f"error: {exc.request.url} answered {exc.response.status_code}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the server at {exc.request.url.copy_with(path='/')} ({exc}); start it "
              "(.venv/bin/dllm-kvq serve) or give its root URL with --url or DLLM_SERVER_URL", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
