"""``python -m service policies export|import``: copy policy tables and KVQuant states between the server's store
(Redis or a directory; ``--store``, default ``DLLM_STORE_URL``, else ``.dllm-kvq/store``) and a local directory (the directory-store
layout, ``artifacts/<kind>/<id>``).

Artifacts keep their content-derived ids; each is parsed and its id recomputed before it is written, so a
corrupted or hand-edited file is refused, never stored under a wrong id. Existing equal artifacts are skipped.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.commands import store_url_arg
from service.config import DEFAULT_STORE_PREFIX, STORE_HELP, default_store
from service.store.base import KIND_KVQUANT_STATE, KIND_POLICY, InvalidName, Store, StoreError, open_store

KINDS = (KIND_POLICY, KIND_KVQUANT_STATE)


@dataclass
class CopyResult:
    """Ids copied and skipped (already there) per kind, and refused ones with the reason."""

    copied: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def content_id(kind: str, data: bytes) -> str:
    """The id an artifact's content gives (ValueError if it is not a valid artifact of that kind)."""
    if kind == KIND_POLICY:
        return PolicyTable.from_json(data).id
    return KVQuantState.from_bytes(data).id


def copy_artifacts(src: Store, dst: Store, kinds: tuple[str, ...] = KINDS) -> CopyResult:
    """Copy every artifact of ``kinds`` from ``src`` to ``dst``, verifying each id against its content."""
    result = CopyResult()
    for kind in kinds:
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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``policies export|import``."""
    p = subparsers.add_parser("policies", help="export/import policies and KVQuant states", description=__doc__)
    verbs = p.add_subparsers(dest="verb", required=True)
    for verb, helptext in (("export", "store -> directory"), ("import", "directory -> store")):
        v = verbs.add_parser(verb, help=helptext)
        v.add_argument("directory", help="local directory (created on export)")
        v.add_argument("--store", default=None, type=store_url_arg, help=STORE_HELP)
        v.add_argument("--store-prefix", default=None,
                       help=f"Redis key prefix (default: DLLM_STORE_PREFIX, else {DEFAULT_STORE_PREFIX})")
        v.add_argument("--kind", choices=KINDS, action="append", help="only this kind (repeatable)")
        v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Copy between the store and the directory; exit 1 if anything was refused or the store failed."""
    try:
        store = open_store(*default_store(args.store, args.store_prefix))
    except InvalidName as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    directory = open_store(args.directory)
    src, dst = (store, directory) if args.verb == "export" else (directory, store)
    try:
        result = copy_artifacts(src, dst, tuple(args.kind or KINDS))
    except StoreError as exc:
        print(f"error: --store {store.location}: {exc}", file=sys.stderr)
        return 1
    for kind in result.copied:
        print(f"{kind}: {len(result.copied[kind])} copied, {len(result.skipped[kind])} already there")
    for name, reason in result.refused.items():
        print(f"refused {name}: {reason}")
    return 1 if result.refused else 0
