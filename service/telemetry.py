"""Prometheus metrics of the server (prometheus-client), on one registry per app, served at ``GET /metrics``.

Names and labels (the README's "Metrics" table is the same list; the Grafana dashboard and alert rules in
``deploy/`` are built from it). ``endpoint`` is the route path, ``status`` the HTTP status code;
``method``/``bits``/``cache_mode``/``policy`` describe a KV quantization configuration (``policy`` is the policy
id for dllm_kvq, the KVQuant state id for kvquant, empty otherwise); dllm_nfe_per_request's ``cache_mode`` is the
request's own (LLaDA2's ``block``, which runs with ``prefix``'s configuration, as ``block``).

=====================================================  =========  =============================================
name                                                   type       labels
=====================================================  =========  =============================================
dllm_requests_total                                    counter    endpoint, status
dllm_requests_cancelled_total                          counter    endpoint
dllm_request_latency_seconds                           histogram  endpoint
dllm_time_to_first_block_seconds                       histogram  endpoint
dllm_queue_time_seconds                                histogram  -
dllm_requests_running                                  gauge      -
dllm_requests_waiting                                  gauge      -
dllm_batch_size                                        histogram  -
dllm_forwards_per_iteration                            histogram  -
dllm_kv_budget_bytes                                   gauge      -
dllm_kv_bytes_reserved                                 gauge      -
dllm_kv_cache_usage_perc                               gauge      -
dllm_cuda_graph_bytes                                  gauge      -
dllm_kv_pool_bytes                                     gauge      -
dllm_requests_waiting_memory                           gauge      -
dllm_nfe_per_request                                   histogram  cache_mode
dllm_prompt_tokens_total                               counter    -
dllm_generation_tokens_total                           counter    -
dllm_kv_effective_bits                                 gauge      method, bits, cache_mode, policy, tensor, accounting
dllm_kv_bytes_held                                     gauge      method, bits, cache_mode, policy
dllm_kv_bf16_bytes                                     gauge      method, bits, cache_mode, policy
dllm_active_config_info                                gauge (1)  model, cache_mode, method, bits, k_group_size,
                                                                  v_group_size, policy, source, key_bias_correction
dllm_config_changes_total                              counter    cache_mode
dllm_policy_k_bits_cap                                 gauge      cache_mode, policy
dllm_kv_configured_bits                                gauge      cache_mode, method, bits, policy, tensor
dllm_shadow_requests_total                             counter    method, bits, cache_mode, policy
dllm_shadow_token_agreement                            histogram  method, bits, cache_mode, policy
dllm_shadow_exact_match_total                          counter    method, bits, cache_mode, policy
dllm_shadow_dropped_total                              counter    -
dllm_eval_score                                        gauge      task, metric, method, bits, cache_mode, policy
dllm_eval_score_timestamp_seconds                      gauge      task, method, bits, cache_mode, policy
dllm_worker_faults_total                               counter    fatal
dllm_ready                                             gauge      -
dllm_store_up                                          gauge      -
dllm_config_ready                                      gauge      cache_mode
dllm_store_active_lost                                 gauge      cache_mode
dllm_store_active_restored_total                       counter    cache_mode
=====================================================  =========  =============================================

``tensor`` is ``k`` or ``v``; ``accounting`` is ``nominal`` (the paper's count: codes at b bits, protected tokens
at 16) or ``storage`` (bytes actually held x 8 / elements), measured over the request's reused tokens;
``dllm_kv_configured_bits`` is the active configuration's nominal bits on full groups, the figure every report of a
policy shows (`service.quant.accounting`; docs/glossary.md "Effective bits"). The KV gauges hold the last
finished request's values for that configuration. ``dllm_shadow_token_agreement`` is the share of response positions, up to the longer of
the two EOS-cut outputs, where the served and the unquantized re-decode agree (DESIGN.md, "token agreement").
``dllm_store_up`` follows the connection (the server pings the store every ``store_check_interval_s``).
``dllm_config_ready`` is 0 while a cache mode's configuration (the store's active entry, or the ``kv_quant``
setting without one) does not resolve or validate against the loaded model: that mode's requests get a 503
(``config_unavailable``) and ``/health/ready`` names it.
Series labelled with a ``policy`` (a fitted artifact's id) are bounded: those of the :data:`ARTIFACT_SERIES_KEEP`
artifacts used most recently are kept, older ones dropped, and a deleted artifact's are dropped at once
(issue 22: 300 stored policies took ``/metrics`` from 273 to 2,073 series and deleting them removed none).
``dllm_store_active_lost`` is 1 from the moment a replica finds, after a store outage, that the store no longer
holds the active configuration it serves (a Redis restarted empty) until the store holds one again.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service.engine.prefix_cache import LABELS as PREFIX_LABELS
from service.engine.prefix_cache import PrefixCache
from service.engine.report import DecodeReport
from service.quant.config import KVQuantConfig

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
NFE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
AGREEMENT_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

CONFIG_LABELS = ("method", "bits", "cache_mode", "policy")
#: Fitted artifacts whose per-artifact series are kept (least recently used dropped first).
ARTIFACT_SERIES_KEEP = 32
#: Label values taken from admin input (an evaluation task or metric name): printable, bounded.
LABEL_VALUE = re.compile(r"[A-Za-z0-9_.,:/+=@ -]{1,128}")


def check_label_value(value: str, field: str) -> str:
    """Return ``value`` or raise ValueError naming ``field``: a metric label taken from a client must be 1-128
    characters of ``[A-Za-z0-9_.,:/+=@ -]`` (no NUL, no newline: Prometheus series stay readable and few)."""
    if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
        raise ValueError(f"{field}: use 1-128 characters of letters, digits and _ . , : / + = @ - or space")
    return value


def config_labels(config: KVQuantConfig, cache_mode: str) -> dict[str, str]:
    """The ``method, bits, cache_mode, policy`` label values of a configuration (bits empty for method none;
    ``policy`` is the id of the fitted artifact the configuration names, whatever its method)."""
    return {
        "method": config.method,
        "bits": "" if config.method == "none" else str(config.bits),
        "cache_mode": cache_mode,
        "policy": config.artifact_id or "",
    }


class Telemetry:
    """Every metric of the server on its own registry (so several apps can live in one test process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dllm_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.cancelled = Counter("dllm_requests_cancelled", "requests cancelled by their client (disconnect, abort; "
                                 "streams too), also counted as status 499", ["endpoint"], registry=r)
        self.latency = Histogram("dllm_request_latency_seconds", "end-to-end latency of generation requests",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_block = Histogram("dllm_time_to_first_block_seconds",
                                     "admission to the first committed block", ["endpoint"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("dllm_queue_time_seconds", "admission to joining the running batch",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.running = Gauge("dllm_requests_running", "rows being decoded", registry=r)
        self.waiting = Gauge("dllm_requests_waiting", "requests admitted and waiting for the worker", registry=r)
        self.batch_size = Histogram("dllm_batch_size", "most requests decoded together with a request",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.forwards = Histogram("dllm_forwards_per_iteration", "forward calls per scheduler iteration",
                                  buckets=(0, 1, 2, 3, 4), registry=r)
        self.row_forwards = Counter("dllm_row_forwards_total", "rows summed over forward calls (divided by the "
                                    "forwards: rows per forward)", registry=r)
        self.kv_budget = Gauge("dllm_kv_budget_bytes", "memory budget for running rows' KV + the largest forward",
                               registry=r)
        self.cuda_graph_bytes = Gauge("dllm_cuda_graph_bytes", "GPU memory held by the later steps' CUDA graphs "
                                      "(reserved out of the KV budget up to DLLM_CUDA_GRAPH_BYTES)", registry=r)
        self.kv_pool_bytes = Gauge("dllm_kv_pool_bytes", "GPU memory of the pools the CUDA graphs read (the "
                                   "running requests' full-precision K/V and packed quantized K/V, counted in "
                                   "dllm_kv_bytes_reserved, and what the pools kept of those that left, counted there "
                                   "too)", registry=r)
        self.kv_reserved = Gauge("dllm_kv_bytes_reserved", "KV bytes reserved by running rows (at their longest), "
                                 "plus what the CUDA graphs' pools hold beyond their live runs",
                                 registry=r)
        # vLLM's name for the same fraction (``vllm:kv_cache_usage_perc``, 0-1 despite the suffix): what an llm-d
        # endpoint picker reads to score replicas by KV-cache use (docs/deployment.md, deploy/llm-d/).
        self.kv_usage = Gauge("dllm_kv_cache_usage_perc", "KV bytes reserved by running rows over the memory "
                              "budget, from 0 to 1", registry=r)
        self.preemptions = Counter("dllm_preemptions_total", "running requests preempted at a block boundary for "
                                   "the head of the queue (their KV freed; they resume later with the same output)",
                                   registry=r)
        self.memory_waiting = Gauge("dllm_requests_waiting_memory",
                                    "requests waiting because the head of the queue does not fit the budget yet",
                                    registry=r)
        self.nfe = Histogram("dllm_nfe_per_request", "forward passes per request", ["cache_mode"],
                             buckets=NFE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("dllm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dllm_generation_tokens", "generated tokens of finished requests",
                                         registry=r)
        self.kv_bits = Gauge("dllm_kv_effective_bits", "effective bits per element of the reused K/V",
                             [*CONFIG_LABELS, "tensor", "accounting"], registry=r)
        self.kv_bytes = Gauge("dllm_kv_bytes_held", "bytes of reused K/V held (peak over blocks)", CONFIG_LABELS,
                              registry=r)
        self.kv_bf16_bytes = Gauge("dllm_kv_bf16_bytes", "bytes the same K/V would take in bf16", CONFIG_LABELS,
                                   registry=r)
        self.active_config = Gauge("dllm_active_config_info", "the active configuration per cache mode (value 1)",
                                   ["model", "cache_mode", "method", "bits", "k_group_size", "v_group_size",
                                    "policy", "source", "key_bias_correction"], registry=r)
        self.configured_bits = Gauge("dllm_kv_configured_bits", "nominal bits per element the active configuration "
                                     "sets on full groups (none: unquantized, or KVQuant: data-dependent)",
                                     ["cache_mode", "method", "bits", "policy", "tensor"], registry=r)
        self.k_bits_cap = Gauge("dllm_policy_k_bits_cap", "nominal K-bit cap the active policy was fitted under",
                                ["cache_mode", "policy"], registry=r)
        self.config_changes = Counter("dllm_config_changes", "active configuration changes applied",
                                      ["cache_mode"], registry=r)
        self.shadow_requests = Counter("dllm_shadow_requests", "requests re-decoded with the unquantized cache",
                                       CONFIG_LABELS, registry=r)
        self.shadow_agreement = Histogram("dllm_shadow_token_agreement",
                                          "token agreement of served vs unquantized re-decode", CONFIG_LABELS,
                                          buckets=AGREEMENT_BUCKETS, registry=r)
        self.shadow_exact = Counter("dllm_shadow_exact_match", "shadow re-decodes with exactly the served text",
                                    CONFIG_LABELS, registry=r)
        self.shadow_dropped = Counter("dllm_shadow_dropped", "shadow re-decodes dropped (queue full)", registry=r)
        self.eval_score = Gauge("dllm_eval_score", "last score reported by the evaluation job",
                                ["task", "metric", *CONFIG_LABELS], registry=r)
        self.eval_time = Gauge("dllm_eval_score_timestamp_seconds", "when the evaluation job reported",
                               ["task", *CONFIG_LABELS], registry=r)
        self.worker_faults = Counter("dllm_worker_faults", "batches that raised", ["fatal"], registry=r)
        self.ready = Gauge("dllm_ready", "1 when the server is ready to serve", registry=r)
        self.store_up = Gauge("dllm_store_up", "1 when the store answered its last call or ping", registry=r)
        self.config_ready = Gauge(
            "dllm_config_ready", "1 while the cache mode's configuration can be served (0: not ready, see "
            "/health/ready)", ["cache_mode"], registry=r)
        self.store_active_lost = Gauge(
            "dllm_store_active_lost", "1 while the store lacks the active configuration this replica serves",
            ["cache_mode"], registry=r)
        self.store_active_restored = Counter(
            "dllm_store_active_restored", "active configurations this replica wrote back after the store lost them",
            ["cache_mode"], registry=r)
        self._active_labels: dict[str, dict[str, str]] = {}
        self._caps: set[tuple[str, str]] = set()
        # Series labelled with a fitted artifact's id, per id, least recently used first: (metric, label values).
        self._artifact_series: OrderedDict[str, set[tuple[Any, tuple[str, ...]]]] = OrderedDict()
        self._series_lock = threading.Lock()
        self._label_names = {id(m): names for m, names in (
            (self.kv_bits, (*CONFIG_LABELS, "tensor", "accounting")), (self.kv_bytes, CONFIG_LABELS),
            (self.kv_bf16_bytes, CONFIG_LABELS), (self.shadow_requests, CONFIG_LABELS),
            (self.shadow_agreement, CONFIG_LABELS), (self.shadow_exact, CONFIG_LABELS),
            (self.eval_score, ("task", "metric", *CONFIG_LABELS)), (self.eval_time, ("task", *CONFIG_LABELS)))}

    def _series(self, family: Any, /, **labels: str) -> Any:
        """``family.labels(**labels)``, remembering the series under its artifact id (bounded, see the module)."""
        child = family.labels(**labels)
        policy = labels.get("policy")
        if policy:
            values = tuple(labels[n] for n in self._label_names[id(family)])
            with self._series_lock:
                self._artifact_series.setdefault(policy, set()).add((family, values))
                self._artifact_series.move_to_end(policy)
                while len(self._artifact_series) > ARTIFACT_SERIES_KEEP:
                    _, series = self._artifact_series.popitem(last=False)
                    self._remove(series)
        return child

    @staticmethod
    def _remove(series: set[tuple[Any, tuple[str, ...]]]) -> None:
        for metric, values in series:
            try:
                metric.remove(*values)
            except KeyError:
                continue  # already gone

    def forget_artifact(self, artifact_id: str) -> None:
        """Drop every series labelled with a deleted artifact's id."""
        with self._series_lock:
            series = self._artifact_series.pop(artifact_id, set())
        self._remove(series)

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        """Publish ``cache``'s counts at every scrape (:class:`PrefixCacheCollector`)."""
        self.registry.register(PrefixCacheCollector(cache))

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)

    def observe_report(self, report: DecodeReport, cache_mode: str, config: KVQuantConfig,
                       request_mode: str | None = None) -> None:
        """Record NFE, tokens and KV cost of a finished batch (one report, several rows): the NFE under the
        request's own cache mode ``request_mode`` (default ``cache_mode``; LLaDA2's ``block`` runs with
        ``prefix``'s configuration), the KV cost under the configuration it ran with (``config`` of
        ``cache_mode``), whose labels are those of `dllm_active_config_info` and the policy's K-bit cap."""
        for row in report.rows:
            self.nfe.labels(request_mode or cache_mode).observe(row.nfe)
            self.generation_tokens.inc(len(row.generated_ids))
        if report.kv is not None:
            labels = config_labels(config, cache_mode)
            kv = report.kv
            for tensor, accounting, value in (
                ("k", "nominal", kv.k_nominal_bits), ("v", "nominal", kv.v_nominal_bits),
                ("k", "storage", kv.k_storage_bits), ("v", "storage", kv.v_storage_bits),
            ):
                self._series(self.kv_bits, **labels, tensor=tensor, accounting=accounting).set(value)
            self._series(self.kv_bytes, **labels).set(kv.bytes_held)
            self._series(self.kv_bf16_bytes, **labels).set(kv.bf16_bytes)

    def set_active(
        self, model: str, cache_mode: str, config: KVQuantConfig, source: str, k_bits_cap: float | None = None,
        configured: dict[str, float] | None = None,
    ) -> None:
        """Show ``config`` as the active configuration of ``cache_mode`` (replacing the previous series), the
        nominal K-bit cap of its policy when it has one (for the alert on served bits above the cap), and its
        configured bits (``{"k", "v"}``, `service.quant.accounting.configured_bits`) when it has them."""
        old = self._active_labels.pop(cache_mode, None)
        if old is not None:
            self.active_config.remove(*old.values())
            for tensor in ("k", "v"):
                try:
                    self.configured_bits.remove(cache_mode, old["method"], old["bits"], old["policy"], tensor)
                except KeyError:  # the old configuration had no configured bits
                    pass
            if old["policy"] and (cache_mode, old["policy"]) in self._caps:
                self._caps.discard((cache_mode, old["policy"]))
                self.k_bits_cap.remove(cache_mode, old["policy"])
        labels = {
            "model": model,
            "cache_mode": cache_mode,
            "method": config.method,
            "bits": config_labels(config, cache_mode)["bits"],
            "k_group_size": "" if config.method == "none" else str(config.k_group_size),
            "v_group_size": "" if config.method == "none" or config.v_group_size is None else str(config.v_group_size),
            "policy": config_labels(config, cache_mode)["policy"],
            "source": source,
            # "on" or "off" for a quantizing method (`KVQuantConfig.key_bias_correction`), empty for none.
            "key_bias_correction": "" if config.method == "none" else ("on" if config.key_bias_correction else "off"),
        }
        self.active_config.labels(**labels).set(1)
        self._active_labels[cache_mode] = labels
        for tensor, value in (configured or {}).items():
            self.configured_bits.labels(cache_mode, config.method, labels["bits"], labels["policy"], tensor).set(value)
        if k_bits_cap is not None and labels["policy"]:
            self.k_bits_cap.labels(cache_mode, labels["policy"]).set(k_bits_cap)
            self._caps.add((cache_mode, labels["policy"]))

    def observe_shadow(self, config: KVQuantConfig, cache_mode: str, agreement: float, exact: bool) -> None:
        """Record one shadow re-decode's token agreement and exact match."""
        labels = config_labels(config, cache_mode)
        self._series(self.shadow_requests, **labels).inc()
        self._series(self.shadow_agreement, **labels).observe(agreement)
        if exact:
            self._series(self.shadow_exact, **labels).inc()
        else:
            self._series(self.shadow_exact, **labels)  # create the series so a 0 is visible

    def observe_eval(
        self, task: str, scores: dict[str, float], config: KVQuantConfig, cache_mode: str, at: float
    ) -> None:
        """Show the evaluation job's last scores of one task under one configuration.

        Raises: ValueError (nothing shown) when the task or a metric name is not a legal label value
        (:func:`check_label_value`)."""
        check_label_value(task, "task")
        for metric in scores:
            check_label_value(metric, f"scores.{metric[:40]!r}")
        labels = config_labels(config, cache_mode)
        for metric, value in scores.items():
            self._series(self.eval_score, task=task, metric=metric, **labels).set(value)
        self._series(self.eval_time, task=task, **labels).set(at)


class PrefixCacheCollector:
    """The prefix cache's series (`service.engine.prefix_cache`), read from its counts at each scrape, per KV
    configuration (`service.engine.prefix_cache.LABELS`: those of `dllm_active_config_info` that change the blocks,
    and ``sides``; cache mode ``block``): queried and hit prompt tokens
    (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` under this server's ``dllm_`` prefix), bytes held and
    evicted, and the capacity."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def describe(self) -> list:
        return []  # the series are made at collection (registering reads nothing)

    def collect(self):
        stats = self.cache.stats()
        families = (
            (CounterMetricFamily, "dllm_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
             "queried_tokens"),
            (CounterMetricFamily, "dllm_prefix_cache_hits",
             "prompt tokens served from the prefix cache (whole blocks; their committed pass not run)", "hit_tokens"),
            (GaugeMetricFamily, "dllm_prefix_cache_bytes", "bytes of the prefix cache's blocks held", "held_bytes"),
            (CounterMetricFamily, "dllm_prefix_cache_evicted_bytes", "bytes evicted from the prefix cache",
             "evicted_bytes"),
            (GaugeMetricFamily, "dllm_prefix_cache_blocks", "blocks held in the prefix cache", "blocks"),
        )
        for kind, name, text, attr in families:
            family = kind(name, text, labels=list(PREFIX_LABELS))
            for label, counts in stats.items():
                # A bare string label (a namespace made without one, as in unit tests) reads as the method.
                values = list(label) if isinstance(label, tuple) else [label, "", "block", *[""] * 5]
                family.add_metric(values, getattr(counts, attr))
            yield family
        yield GaugeMetricFamily("dllm_prefix_cache_capacity_bytes", "most bytes the prefix cache may hold "
                                "(prefix_cache_bytes)", value=self.cache.capacity_bytes)
