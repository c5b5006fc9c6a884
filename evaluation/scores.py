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

from service.store.base import KIND_EVAL_SCORES, open_store


class ScoreReportError(RuntimeError):
    """The server refused a score report (the message has its status and error message; ``status`` the code)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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
        """Send one matrix result (`evaluation.matrix.run_cell_task`); returns the stored report's id."""
        return self.send(score_report(result))

    def send(self, report: dict[str, Any]) -> str:
        """Send one ``EvalScoreReport`` body; returns the stored report's id."""
        if self.server_url:
            resp = httpx.post(f"{self.server_url}/admin/eval_scores", json=report, timeout=self.timeout_s,
                              headers={"Authorization": f"Bearer {self.admin_key}"})
            if resp.status_code != 201:
                try:
                    detail = resp.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    detail = " ".join(resp.text.split())[:300]
                raise ScoreReportError(f"POST /admin/eval_scores answered {resp.status_code}: {detail}",
                                       resp.status_code)
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


def reports_from_lm_eval(results: dict[str, Any], cache_mode: str | None = None,
                         kv_quant: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One ``EvalScoreReport`` body per task of an lm-eval results file (``--output_path``'s ``results_*.json``).

    The configuration is read from the run where lm-eval recorded it: ``dllm-kvq``'s model_args, then request
    fields in ``gen_kwargs`` (``cache_mode``, ``kv_quant``), then ``cache_mode`` / ``kv_quant`` given here, which
    win. An HTTP run that relied on the server's active configuration recorded none of it: then both must be given.

    Raises:
        ValueError: the configuration cannot be determined (the message says what to pass).
    """
    from evaluation.model_args import EvalModelArgs

    config = results.get("config", {})
    gen_kwargs = config.get("gen_kwargs") or {}
    mode, kv = gen_kwargs.get("cache_mode"), gen_kwargs.get("kv_quant")
    if config.get("model") == "dllm-kvq":
        raw = config.get("model_args") or {}
        if isinstance(raw, str):
            from lm_eval.utils import simple_parse_args_string

            raw = simple_parse_args_string(raw)
        args = EvalModelArgs.parse({k: v for k, v in raw.items() if v is not None})
        mode = mode or args.cache_mode
        kv = kv or args.kv_config.model_dump(mode="json")
    mode, kv = cache_mode or mode, kv_quant or kv
    if mode is None or kv is None:
        raise ValueError(f"lm-eval's results do not say which cache mode and KV quantization {config.get('model')} "
                         "served; pass --cache-mode and --kv-quant (the server's active configuration)")
    limit = config.get("limit")
    reports = []
    for task, metrics in results["results"].items():
        scores = {k: float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len"}
        if scores:
            reports.append({"task": task, "scores": scores, "kv_quant": kv, "cache_mode": mode,
                            "limit": int(limit) if limit else None,
                            "details": {"lm_eval_model": config.get("model"), "n_samples": results.get(
                                "n-samples", {}).get(task)}})
    return reports
