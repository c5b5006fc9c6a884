"""Read a server's /metrics with prometheus_client.parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metrics(url: str) -> dict:
    """Every sample of ``url``/metrics as ``{(name, sorted label pairs): value}``."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(samples: dict, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
