"""``python -m service policies list|show|activate|deactivate|diff|audit|export|import``: the fitted policies and
KVQuant states, and the active configuration per cache mode, from the command line.

Where: ``--server URL`` talks to a running server's ``/admin`` routes with the admin key from ``DLLM_ADMIN_KEY``
(``--admin-key-env``); otherwise ``--store`` (default ``DLLM_STORE_URL``, else ``.dllm-kvq/store``) is read and
written directly, and a server on the same store follows the change (its store event). Activation is validated
as the admin route and `service.store.base.Store.set_active` validate it (over a store, against ``--model``'s
spec, read without loading the model): nothing that a server could not serve becomes active.

``export``/``import`` copy policy tables and KVQuant states between the store and a local directory (the
directory-store layout, ``artifacts/<kind>/<id>``). Artifacts keep their content-derived ids; each is parsed and its
id recomputed before it is written, so a corrupted or hand-edited file is refused, never stored under a wrong id.
Existing equal artifacts are skipped.

Exit status: 0, 1 when the store or server failed (or an artifact was refused on import/export), 2 for bad input
(one line naming what and what to do).
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.commands import prog, store_url_arg

CACHE_MODES = ("none", "prefix", "dual")


class PoliciesError(Exception):
    """Bad input: one line, exit 2."""


class BackendError(Exception):
    """The store or server failed: one line, exit 1."""


@dataclass
class CopyResult:
    """Ids copied and skipped (already there) per kind, and refused ones with the reason."""

    copied: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def registered_kinds() -> tuple[str, ...]:
    """The store kinds of the registered methods' artifact types (`service.quant.registry`), in registration
    order (``policy``, ``kvquant_state`` ...). Read when a verb runs, so ``--help`` imports no artifact module."""
    from service.quant.registry import artifact_types

    return tuple(cls.KIND for cls in artifact_types().values())


def what() -> str:
    """The registered artifact types' labels: ``"KVQuant state or policy table"``."""
    from service.quant.registry import artifact_types

    labels = [cls.LABEL for cls in artifact_types().values()]
    return " or ".join([", ".join(labels[:-1]), labels[-1]] if len(labels) > 1 else labels)


def content_id(kind: str, data: bytes) -> str:
    """The id an artifact's content gives (ValueError if it is not a valid artifact of that kind)."""
    return artifact_type(kind).from_bytes(data).id


def copy_artifacts(src, dst, kinds: tuple[str, ...] | None = None) -> CopyResult:
    """Copy every artifact of ``kinds`` (default: every registered kind, `registered_kinds`) from the store ``src`` to
    ``dst``, verifying each id against its content."""
    result = CopyResult()
    for kind in kinds or registered_kinds():
        result.copied[kind], result.skipped[kind] = [], []
        for artifact_id in src.list(kind):
            data = src.get(kind, artifact_id)
            try:
                if content_id(kind, data) != artifact_id:
                    raise ValueError("its content gives another id")
            except ValueError as exc:
                result.refused[f"{kind}/{artifact_id}"] = str(exc)
                continue
            if dst.exists(kind, artifact_id):
                result.skipped[kind].append(artifact_id)
            else:
                dst.put(kind, data, artifact_id)
                result.copied[kind].append(artifact_id)
    return result


# ---- the two places policies are managed through ------------------------------------------------------------------


def artifact_type(kind: str) -> type:
    """The artifact class of a store kind among the registered methods' (`service.quant.registry`).

    Raises:
        PoliciesError: no registered method keeps artifacts of that kind (the message lists the kinds).
    """
    from service.quant.registry import artifact_types

    found = [cls for cls in artifact_types().values() if cls.KIND == kind]
    if not found:
        raise PoliciesError(f"unknown kind {kind!r}; legal: {', '.join(registered_kinds())}")
    return found[0]


def method_of(kind: str) -> str:
    """The quantization method that applies artifacts of ``kind`` (``policy`` -> ``dllm_kvq``)."""
    from service.quant.registry import method, methods

    return next(name for name in methods(with_artifact=True) if method(name).store_kind == kind)


def cli_key_id() -> str:
    """The audit log's key id of a change written by this command straight into a store: ``cli:<user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name (a container running under a bare uid)
        return "cli"


class StoreSide:
    """Policies in a store, read and written directly (`service.store.base.Store`)."""

    def __init__(self, store, model: str | None) -> None:
        self.store = store
        self.model = model
        self.where = f"--store {store.location}"
        self._spec = None

    def spec(self):
        """The ``--model`` checkpoint's spec (read once, without loading the model)."""
        if self._spec is None:
            from service.engine.errors import EngineInputError
            from service.engine.loading import checkpoint_spec

            try:
                self._spec = checkpoint_spec(self.model)
            except EngineInputError as exc:
                raise PoliciesError(f"--model: {exc}") from None
        return self._spec

    def ids(self, kind: str) -> list[tuple[str, float]]:
        """``(id, created_at)`` of every artifact of ``kind``, oldest first."""
        return [(i, self.store.info(kind, i).created_at) for i in self.store.list(kind)]

    def summary(self, kind: str, artifact_id: str) -> dict[str, Any] | None:
        """The artifact's summary (a policy table's JSON, a KVQuant state's metadata), None if absent."""
        from service.store.base import ArtifactNotFound

        try:
            data = self.store.get(kind, artifact_id)
        except ArtifactNotFound:
            return None
        return artifact_type(kind).from_bytes(data).summary()

    def active(self) -> list[dict[str, Any]]:
        """Every active entry (all models): fingerprint, cache_mode, config, set_at, key_id."""
        return [e.model_dump(mode="json") for e in self.store.list_active()]

    def current(self, cache_mode: str) -> dict[str, Any] | None:
        """The store's active configuration of ``--model`` for ``cache_mode`` (a `KVQuantConfig` as JSON), or
        None when it holds none."""
        entry = self.store.get_active(self.spec().fingerprint, cache_mode)
        return None if entry is None else entry.config.model_dump(mode="json")

    def activate(self, cache_mode: str, config) -> dict[str, Any]:
        """`Store.set_active` against ``--model``'s spec; the audit entry (old, new)."""
        from service.store.base import ArtifactNotFound, ConfigInvalid, InvalidName

        spec = self.spec()
        try:
            audit = self.store.set_active(spec, cache_mode, config, key_id=cli_key_id())
        except (ConfigInvalid, ArtifactNotFound, InvalidName) as exc:
            raise PoliciesError(f"refused for {spec.model_id} ({spec.fingerprint[:12]}): {exc}") from None
        return audit.model_dump(mode="json")

    def audit(self, limit: int) -> list[dict[str, Any]]:
        return [e.model_dump(mode="json") for e in self.store.audit(limit)]

    def close(self) -> None:
        self.store.close()


class ServerSide:
    """Policies through a running server's ``/admin`` routes (bearer admin key)."""

    def __init__(self, url: str, key: str, key_env: str) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.key_env = key_env
        self.where = f"--server {self.url}"
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def _call(self, method: str, path: str, missing_ok: bool = False, **kwargs) -> Any:
        """The JSON answer of an admin route (None for a 404 with ``missing_ok``); PoliciesError for a refusal
        (4xx, naming the key setting on 401/403), BackendError when the server cannot be reached or fails."""
        import httpx

        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise BackendError(f"{self.where}: cannot reach it ({exc or type(exc).__name__}); start the server "
                               f"(`{prog('service', 'serve')}`) or fix --server") from None
        if response.status_code < 400:
            return response.json() if response.content else None
        if response.status_code == 404 and missing_ok:
            return None
        try:
            error = response.json()["error"]
            message = error.get("message") or str(error)
        except (ValueError, KeyError, TypeError, AttributeError):
            message = response.text.strip()[:300]
        if response.status_code == 403:
            raise PoliciesError(f"{self.where}: {message}; start the server with DLLM_ADMIN_KEY set (16+ characters) "
                                f"and give the same key here in {self.key_env}")
        if response.status_code == 401:
            raise PoliciesError(f"{self.where}: {message}; {self.key_env} must hold the server's admin key")
        if response.status_code in (400, 404, 422):
            raise PoliciesError(f"{self.where}: refused: {message}")
        raise BackendError(f"{self.where}: {method} {path} answered {response.status_code}: {message}")

    def ids(self, kind: str) -> list[tuple[str, float]]:
        plural = artifact_type(kind).PLURAL
        return [(row["id"], row["created_at"]) for row in self._call("GET", f"/admin/{plural}")["data"]]

    def summary(self, kind: str, artifact_id: str) -> dict[str, Any] | None:
        summary = self._call("GET", f"/admin/{artifact_type(kind).PLURAL}/{artifact_id}", missing_ok=True)
        if summary is not None:
            summary.pop("id", None)
        return summary

    def active(self) -> list[dict[str, Any]]:
        view = self._call("GET", "/admin/active")
        return list(view["store"].values())

    def current(self, cache_mode: str) -> dict[str, Any] | None:
        """The store's active configuration of the served model for ``cache_mode``, or None."""
        entry = self._call("GET", "/admin/active")["store"].get(cache_mode)
        return None if entry is None else entry["config"]

    def activate(self, cache_mode: str, config) -> dict[str, Any]:
        return self._call("PUT", f"/admin/active/{cache_mode}", json=config.model_dump(mode="json", exclude_none=True))

    def audit(self, limit: int) -> list[dict[str, Any]]:
        return self._call("GET", "/admin/audit", params={"limit": limit})

    def close(self) -> None:
        self.client.close()


# ---- presentation ---------------------------------------------------------------------------------------------


def when(seconds: float | None) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM`` UTC."""
    if seconds is None:
        return "-"
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M")


def configured_k_bits(kind: str, summary: dict[str, Any]) -> float | None:
    """An artifact's configured K bits, the figure every report of it shows (docs/glossary.md, "Effective bits";
    its type's `Artifact.configured_k_bits`: a policy's per-layer budgets); None where ``bits`` is its figure (a
    KVQuant state) or for a summary that is not a whole artifact."""
    return artifact_type(kind).configured_k_bits(summary)


def describe_config(config: dict[str, Any] | None) -> str:
    """A configuration in a few words: ``dllm_kvq 2-bit policy_id=policy-1a2b...`` (``none`` = unquantized)."""
    if config is None:
        return "(none set)"
    if config.get("method", "none") == "none":
        return "none (unquantized)"
    words = [config["method"], f"{config.get('bits', 4)}-bit"]
    words += [f"{k}={v}" for k, v in config.items() if k.endswith("_id") and v]
    if config.get("key_bias_correction"):
        words.append("key_bias_correction")
    return " ".join(words)


def find_artifact(side, artifact_id: str) -> tuple[str, str, dict[str, Any]]:
    """The kind, full id and summary of a stored policy or KVQuant state that ``artifact_id`` names, in full or by
    an unambiguous prefix (as ``git`` takes an abbreviated id). PoliciesError naming where it was looked for when
    none matches, listing the candidates when several do."""
    from service.store.base import ambiguous_id, ids_matching

    found = [(kind, i) for kind in registered_kinds() for i in ids_matching([i for i, _ in side.ids(kind)], artifact_id)]
    found = [(kind, i) for kind, i in found if i == artifact_id] or found
    if len(found) > 1:
        raise PoliciesError(f"{ambiguous_id(what(), artifact_id, [i for _, i in found])} in {side.where}")
    summary = side.summary(*found[0]) if found else None
    if summary is None:
        raise PoliciesError(f"no {what()} with id {artifact_id!r} in {side.where}; "
                            f"`{prog('service', 'policies list')}` lists them")
    return found[0][0], found[0][1], summary


def config_from(side, target: str):
    """The `KVQuantConfig` that ``activate``'s TARGET names: an inline JSON object, a file with one (an activation
    body of ``calibrate report``), or the id of a stored policy or KVQuant state (its method, bits and group
    sizes)."""
    from pydantic import ValidationError

    from service.commands import describe_validation_error
    from service.quant.config import KVQuantConfig

    if target.lstrip().startswith("{"):
        text, what = target, "the JSON configuration"
    elif Path(target).is_file():
        text, what = Path(target).read_text(), target
    elif "/" in target or target.endswith(".json"):
        raise PoliciesError(f"{target}: no such file; give a policy or state id, an activation body file "
                            "(calibrate report writes them under runs/calibration/activate/) or a JSON object")
    else:
        kind, full_id, summary = find_artifact(side, target)
        fixed = {name: summary[name] for name in artifact_type(kind).activation_fields() if name in summary}
        return KVQuantConfig(method=method_of(kind), artifact_id=full_id, **fixed)
    try:
        config = KVQuantConfig.model_validate_json(text)
    except ValidationError as exc:
        raise PoliciesError(f"{what}: not a KV quantization configuration: {describe_validation_error(exc)}") from None
    return _full_id(side, config)


def _full_id(side, config):
    """``config`` naming its policy or state in full where its id is a prefix that starts one stored id (as an id
    TARGET may be); PoliciesError listing them where it starts several; anything else as it is (an id the store
    lacks is refused by the activation, naming its field)."""
    from service.quant.registry import method
    from service.store.base import ambiguous_id, ids_matching

    kind = method(config.method).store_kind
    if kind is None or config.artifact_id is None:
        return config
    stored = [i for i, _ in side.ids(kind)]
    if config.artifact_id in stored:
        return config
    found = ids_matching(stored, config.artifact_id)
    if len(found) > 1:
        raise PoliciesError(f"{ambiguous_id(kind, config.artifact_id, found)} in {side.where}")
    return config.model_copy(update={"artifact_id": found[0]}) if found else config


# ---- verbs -------------------------------------------------------------------------------------------------------


def run_list(side, args: argparse.Namespace) -> int:
    active: dict[str, list[str]] = {}
    for entry in side.active():
        for value in entry["config"].values():
            if isinstance(value, str):
                active.setdefault(value, []).append(entry["cache_mode"])
    rows = []
    for kind in registered_kinds():
        for artifact_id, created in side.ids(kind):
            summary = side.summary(kind, artifact_id) or {}
            bits = configured_k_bits(kind, summary)
            rows.append({"id": artifact_id, "kind": kind, "method": method_of(kind),
                         "model": summary.get("model_id"), "cache_mode": summary.get("cache_mode"),
                         "bits": summary.get("bits"), "configured_k_bits": bits,
                         "weights_fingerprint": summary.get("weights_fingerprint"), "created_at": created,
                         "active_for": sorted(set(active.get(artifact_id, [])))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no {what()} in {side.where}; `calibrate all` fits them")
        return 0
    header = ("ID", "METHOD", "MODEL", "CACHE", "BITS", "K BITS", "FITTED ON", "CREATED (UTC)", "ACTIVE")
    table = [header] + [
        (r["id"], r["method"], str(r["model"]), r["cache_mode"] or "any", str(r["bits"]),
         f"{r['configured_k_bits']:.3f}" if r["configured_k_bits"] is not None else "-",
         (r["weights_fingerprint"] or "-")[:12], when(r["created_at"]), ",".join(r["active_for"]) or "-")
        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print("K BITS: configured K bits (docs/glossary.md), (b(G-p)+16p)/G averaged over layers; FITTED ON: the weights "
          "fingerprint")
    return 0


def run_show(side, args: argparse.Namespace) -> int:
    kind, full_id, summary = find_artifact(side, args.id)
    if args.json:
        print(json.dumps({"id": full_id, "kind": kind, **summary}, indent=2))
        return 0
    print(f"{full_id}  ({method_of(kind)} {kind})")
    for name, value in summary.items():
        if name not in ("layers", "provenance"):
            print(f"  {name}: {value}")
    bits = configured_k_bits(kind, summary)
    if bits is not None:
        print(f"  configured K bits: {bits:.3f}")
    provenance = summary.get("provenance") or {}
    for name in ("created_at", "data", "code"):
        if provenance.get(name):
            print(f"  provenance.{name}: {provenance[name]}")
    for i, layer in enumerate(summary.get("layers") or []):
        print(f"  layer {i:>3}: {layer['score_type']:<9} p={layer['p']}")
    return 0


def run_activate(side, args: argparse.Namespace) -> int:
    from service.quant.config import KVQuantConfig

    if args.verb == "deactivate":
        current = side.current(args.cache_mode)
        if current is not None and current.get("method") == "none":
            # Already unquantized in the store: writing it again would only log a "none -> none" change.
            if args.json:
                print(json.dumps({"cache_mode": args.cache_mode, "unchanged": True, "config": current}, indent=2))
            else:
                print(f"{args.cache_mode}: already unquantized (none) in {side.where}; nothing written")
            return 0
    config = KVQuantConfig() if args.verb == "deactivate" else config_from(side, args.target)
    audit = side.activate(args.cache_mode, config)
    if args.json:
        print(json.dumps(audit, indent=2))
        return 0
    print(f"{args.cache_mode}: {describe_config(audit.get('old'))} -> {describe_config(audit['new'])} "
          f"(by {audit.get('key_id') or '-'} at {when(audit['at'])} UTC; model {audit['fingerprint'][:12]})")
    return 0


def run_diff(side, args: argparse.Namespace) -> int:
    kinds, ids, summaries = zip(*(find_artifact(side, i) for i in (args.a, args.b)), strict=True)
    a, b = summaries
    if kinds[0] != kinds[1]:
        raise PoliciesError(f"{ids[0]} is a {kinds[0]}, {ids[1]} a {kinds[1]}; diff compares two of one kind")
    lines = []
    for name in sorted((set(a) | set(b)) - {"layers"}):
        if a.get(name) != b.get(name):
            lines.append(f"{name}: {a.get(name)} -> {b.get(name)}")
    bits = configured_k_bits(kinds[0], a), configured_k_bits(kinds[1], b)
    if bits[0] != bits[1] and None not in bits:
        lines.append(f"configured K bits: {bits[0]:.3f} -> {bits[1]:.3f}")
    layers_a, layers_b = a.get("layers") or [], b.get("layers") or []
    for i in range(max(len(layers_a), len(layers_b))):
        la = layers_a[i] if i < len(layers_a) else None
        lb = layers_b[i] if i < len(layers_b) else None
        if la != lb:
            show = [f"{x['score_type']} p={x['p']}" if x else "(absent)" for x in (la, lb)]
            lines.append(f"layer {i}: {show[0]} -> {show[1]}")
    print(f"--- {ids[0]}\n+++ {ids[1]}")
    print("\n".join(lines) if lines else "(same content)")
    return 0


def run_audit(side, args: argparse.Namespace) -> int:
    entries = side.audit(args.limit)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    if not entries:
        print(f"no configuration changes in {side.where}")
    for e in entries:
        print(f"{when(e['at'])}  {e['cache_mode']:<6} model {e['fingerprint'][:12]}  by {e.get('key_id') or '-'}:  "
              f"{describe_config(e.get('old'))} -> {describe_config(e['new'])}")
    return 0


VERBS = {"list": run_list, "show": run_show, "activate": run_activate, "deactivate": run_activate,
         "diff": run_diff, "audit": run_audit}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``policies`` and its verbs."""
    from service.config import DEFAULT_STORE_PREFIX, STORE_HELP

    p = subparsers.add_parser("policies", help="list, show, activate, diff, audit, export, import policies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="verb")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--store", default=None, type=store_url_arg, help=STORE_HELP)
    where.add_argument("--store-prefix", default=None,
                       help=f"Redis key prefix (default: DLLM_STORE_PREFIX, else {DEFAULT_STORE_PREFIX})")
    managed = argparse.ArgumentParser(add_help=False, parents=[where])
    managed.add_argument("--server", default=None,
                         help="a running server's root URL (http://HOST:PORT) to go through instead of --store "
                              "(default: none, the store directly)")
    managed.add_argument("--admin-key-env", default="DLLM_ADMIN_KEY",
                         help="environment variable holding the server's admin key, with --server (default "
                              "%(default)s)")
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="print JSON instead of text (default: text)")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", default=None,
                       help="over --store: the served checkpoint whose spec the configuration is checked against "
                            "(dir or HF repo id; default: the embedded model); over --server the server's model")

    def verb(name: str, helptext: str, parents: list) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=helptext, description=helptext, parents=parents)
        v.set_defaults(func=run)
        return v

    verb("list", "every policy and KVQuant state: method, model, cache mode, bits, configured K bits, the weights it "
         "was fitted on, date, where active", [managed, json_flag])
    verb("show", "one policy or KVQuant state", [managed, json_flag]).add_argument(
        "id", help="its id (policy-... or kvquant-...; `list` shows them)")
    activate = verb("activate", "make a configuration the active one of a cache mode, validated as the server "
                    "validates it", [managed, model, json_flag])
    activate.add_argument("cache_mode", choices=CACHE_MODES, help="the cache mode it serves")
    activate.add_argument("target", metavar="ID|FILE|JSON",
                          help="a stored policy or KVQuant state id (its bits and group sizes are used), an "
                               "activation body file (runs/calibration/activate/*.json) or an inline JSON "
                               "configuration such as '{\"method\": \"kivi\", \"bits\": 2}'")
    verb("deactivate", "serve a cache mode unquantized (method none) from now on",
         [managed, model, json_flag]).add_argument(
        "cache_mode", choices=CACHE_MODES, help="the cache mode")
    diff = verb("diff", "what differs between two policies (or two KVQuant states)", [managed])
    diff.add_argument("a", help="the first id")
    diff.add_argument("b", help="the second id")
    verb("audit", "the newest configuration changes: when, cache mode, model, by whom, old -> new",
         [managed, json_flag]).add_argument("--limit", type=_audit_limit, default=20,
                                            help=f"how many entries, newest first: 1-{MAX_AUDIT_LIMIT} "
                                                 "(default %(default)s)")
    for name, helptext in (("export", "copy every policy and KVQuant state from the store into a directory"),
                           ("import", "copy a directory's policies and KVQuant states into the store")):
        v = verb(name, helptext, [where])
        v.add_argument("directory", help="local directory in the directory-store layout (created on export)")
        v.add_argument("--kind", action="append",
                       help="only this kind: policy, kvquant_state or another registered method's (repeatable; "
                            "default: all)")


#: Most audit entries one ``audit`` asks for: the bound of the server's ``GET /admin/audit?limit=``, so the store
#: and the server sides take the same values.
MAX_AUDIT_LIMIT = 10_000


def _audit_limit(text: str) -> int:
    """``--limit``: an integer in [1, MAX_AUDIT_LIMIT] (argparse type; anything else is a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of entries, got {text!r}") from None
    if not 1 <= value <= MAX_AUDIT_LIMIT:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_AUDIT_LIMIT} entries, got {value}")
    return value


#: Verbs that only read the store (``export`` reads it and writes a local folder).
READ_VERBS = frozenset({"list", "show", "diff", "audit", "export"})


def open_side(args: argparse.Namespace):
    """A `ServerSide` (``--server``) or a `StoreSide` (``--store``), or PoliciesError naming what is missing."""
    import os

    from service.config import default_store
    from service.store.base import InvalidName, open_store

    if getattr(args, "server", None):
        if args.store:
            raise PoliciesError("give --server or --store, not both: over --server the server's own store is used")
        key = os.environ.get(args.admin_key_env)
        if not key:
            raise PoliciesError(f"--server {args.server} needs the server's admin key in {args.admin_key_env} "
                                f"(export {args.admin_key_env}=...; the server must have been started with it)")
        return ServerSide(args.server, key, args.admin_key_env)
    if args.store and args.verb in READ_VERBS:
        # A directory store is made on first write; a verb that only reads must not make one at a typo.
        path = args.store.removeprefix("file://") if "://" not in args.store.removeprefix("file://") else None
        if path is not None and not Path(path).expanduser().is_dir():
            raise PoliciesError(f"--store {args.store}: no such directory (a directory store is made by "
                                "`calibrate` or `policies activate`/`import`); check the path")
    try:
        store = open_store(*default_store(args.store, args.store_prefix))
    except InvalidName as exc:
        raise PoliciesError(str(exc)) from None
    return StoreSide(store, getattr(args, "model", None))


def run_copy(args: argparse.Namespace) -> int:
    """``export`` / ``import``: copy between the store and the directory."""
    from service.store.base import StoreError, open_store

    directory = Path(args.directory)
    if args.verb == "import" and not directory.is_dir():
        raise PoliciesError(f"{args.directory}: no such directory; give the folder `policies export` wrote")
    if directory.exists() and not directory.is_dir():
        raise PoliciesError(f"{args.directory} is a file; give a directory")
    side = open_side(args)
    store = side.store
    try:
        local = open_store(str(directory))
    except StoreError as exc:  # a folder that cannot be made: under a file, read-only, /proc
        store.close()
        raise PoliciesError(f"{args.directory}: {exc}") from None
    src, dst = (store, local) if args.verb == "export" else (local, store)
    try:
        for kind in args.kind or ():
            artifact_type(kind)  # PoliciesError naming the legal kinds
        result = copy_artifacts(src, dst, tuple(args.kind or registered_kinds()))
    except StoreError as exc:
        raise BackendError(f"--store {store.location}: {exc}") from None
    finally:
        store.close()
    for kind in result.copied:
        print(f"{kind}: {len(result.copied[kind])} copied, {len(result.skipped[kind])} already there")
    for name, reason in result.refused.items():
        print(f"refused {name}: {reason}")
    return 1 if result.refused else 0


def run(args: argparse.Namespace) -> int:
    """Run a verb; exit 0, 1 (store or server failed, or an artifact refused) or 2 (bad input), one line each."""
    from service.store.base import StoreError

    name = prog("service", "policies", args.verb)
    try:
        if args.verb in ("export", "import"):
            return run_copy(args)
        side = open_side(args)
        try:
            return VERBS[args.verb](side, args)
        except StoreError as exc:
            raise BackendError(f"{side.where}: {exc}") from None
        finally:
            side.close()
    except PoliciesError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
