"""Accuracy telemetry: each finished task score goes to the server's evaluation-score endpoint and the store.

``POST /admin/eval_scores`` (bearer admin key) stores the report in the server's store (kind ``eval_scores``) and
shows it in the server's ``dllm_eval_score`` gauge, labelled by task, metric, method, bits, cache mode and policy,
next to the online agreement metrics. Without a server, the same record goes straight into the store
(``--store``), so a later server or dashboard can read it. With both, the server stores it (once).
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from service.policy.store import KIND_EVAL_SCORES, open_store


class ScoreReportError(RuntimeError):
    """The server refused a score report (the message has its status and error body)."""


def score_report(result: dict[str, Any]) -> dict[str, Any]:
    """The ``EvalScoreReport`` body for one matrix result (`evaluation.matrix.run_cell_task`)."""
    metrics = {k: v for k, v in result["metrics"].items() if "stderr" not in k and k != "sample_len"}
    return {
        "task": result["task"],
        "scores": metrics,
        "kv_quant": result["config"],
        "cache_mode": result["cell"]["cache_mode"],
        "model_fingerprint": result["fingerprint"],
        "limit": result["settings"]["limit"],
        "details": {"primary_metric": result["metric"], "score_percent": result["score"], "kv": result["kv"],
                    "seconds": result["seconds"], "documents": len(result["records"]), "model": result["model"]},
    }


class ScoreReporter:
    """Callable given each finished result; pushes it to the server and/or the store (module docstring).

    Args:
        server_url: server base URL (``http://host:port``), or None.
        admin_key_env: environment variable with the admin key (the key is never a command-line argument).
        store_url: store URL used when no server is given.
        timeout_s: HTTP timeout.

    Raises (on call):
        ScoreReportError: the server answered with an error status.
        KeyError: the admin key variable is not set (raised at construction when a server is given).
    """

    def __init__(self, server_url: str | None = None, admin_key_env: str = "DLLM_ADMIN_KEY",
                 store_url: str | None = None, timeout_s: float = 30.0) -> None:
        self.server_url = server_url.rstrip("/") if server_url else None
        self.store_url = store_url
        self.timeout_s = timeout_s
        self.admin_key = None
        if self.server_url:
            if admin_key_env not in os.environ:
                raise KeyError(f"set {admin_key_env} to the server's admin key to push scores to {self.server_url}")
            self.admin_key = os.environ[admin_key_env]
        self.sent: list[str] = []  # ids of the stored reports, in order

    def __call__(self, result: dict[str, Any]) -> str:
        report = score_report(result)
        if self.server_url:
            resp = httpx.post(f"{self.server_url}/admin/eval_scores", json=report, timeout=self.timeout_s,
                              headers={"Authorization": f"Bearer {self.admin_key}"})
            if resp.status_code != 201:
                raise ScoreReportError(f"POST /admin/eval_scores answered {resp.status_code}: {resp.text}")
            artifact_id = resp.json()["id"]
        elif self.store_url:
            store = open_store(self.store_url)
            try:
                artifact_id = store.put_json(KIND_EVAL_SCORES, report | {"at": time.time(), "key_id": None})
            finally:
                store.close()
        else:
            raise ValueError("ScoreReporter needs a server_url or a store_url")
        self.sent.append(artifact_id)
        return artifact_id
