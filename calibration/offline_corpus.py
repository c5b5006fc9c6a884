"""Build the small offline calibration corpus from the Python standard library (no network needed).

The paper's corpus (C4, UltraChat, ARC, CodeSearchNet-Python; see :mod:`calibration.collect`) needs a download.
So that the job runs anywhere, the project ships three buckets made of real English documentation and real
Python code taken from the standard library of the interpreter that runs this script, through ``inspect``:

* ``instruction``: "Describe ..." prompts for modules and classes, answered by their docstrings
  (documentation paragraphs, the role C4 / UltraChat text plays in the paper);
* ``qa``: "Question: what does ``f(signature)`` do? Answer:" prompts, answered by the function's docstring
  (short factual answers, the role ARC plays);
* ``code``: "Write the function ..." prompts carrying the docstring's summary, answered by the function's source
  (the role CodeSearchNet-Python plays).

Records are selected deterministically (sorted names, length bounds), so the same Python version gives the same
files. Sources and licence (PSF License Agreement) are written to ``SOURCES.md`` next to the files.

Run: ``python -m calibration.offline_corpus [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import platform
import sys
import textwrap
import warnings
from pathlib import Path

from calibration.corpus import OFFLINE_CORPUS_DIR, write_bucket

#: Pure-Python standard-library modules with good docstrings (C extension modules have no source).
MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "email.utils", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt",
    "gettext", "glob", "gzip", "heapq", "hmac", "html", "html.parser", "http.cookies", "imaplib", "inspect",
    "ipaddress", "json", "json.decoder", "json.encoder", "keyword", "linecache", "locale", "logging", "mailbox",
    "mimetypes", "netrc", "ntpath", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pkgutil", "platform", "plistlib", "poplib", "posixpath", "pprint", "profile", "pstats", "queue", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib",
    "socketserver", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser", "zipfile",
)

#: Records per bucket (the paper's collection keeps 1000/500/300/200 from its sources; we keep less, to ship).
BUCKET_SIZES = {"instruction": 300, "qa": 150, "code": 150}
MIN_CHARS, MAX_CHARS = 160, 1600

LICENCE = """\
# Offline calibration corpus: sources and licence

Built by `python -m calibration.offline_corpus` from the standard library of CPython {version}
({implementation}, {platform}). Every record's `source` field names the object it came from
(`module:qualified.name`).

- `instruction.jsonl`: module and class docstrings (English documentation paragraphs) as answers to
  "Describe ..." prompts.
- `qa.jsonl`: function docstrings as answers to "Question: what does `f(signature)` do?" prompts.
- `code.jsonl`: function source code (docstring included) as answers to "Write the function ..." prompts.

Schema: JSON Lines, `{{"prompt": str, "answer": str, "source": str}}` (see `calibration/corpus.py`).

Licence: the text and code are taken verbatim from the CPython standard library, Copyright (c) 2001-2024 Python
Software Foundation, All Rights Reserved, distributed under the PSF License Agreement for Python
(https://docs.python.org/3/license.html), which permits reproduction and derived works provided the
copyright notice and the agreement are retained; this file retains them. The prompts are templates written
by this project.
"""


def _doc(obj: object) -> str | None:
    # Only the object's own docstring (inspect.getdoc inherits from base classes, which would repeat text).
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    return inspect.cleandoc(doc) if doc else None


def _own_members(module) -> list[tuple[str, object]]:
    """Functions and classes defined in ``module`` itself, sorted by name."""
    members = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            members.append((name, obj))
    return members


def _fits(text: str | None) -> bool:
    return text is not None and MIN_CHARS <= len(text) <= MAX_CHARS


def _signature(function) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


def build_records() -> dict[str, list[dict[str, str]]]:
    """Collect the three buckets from :data:`MODULES`; each list capped at :data:`BUCKET_SIZES`."""
    buckets: dict[str, list[dict[str, str]]] = {name: [] for name in BUCKET_SIZES}
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a module missing on this platform is skipped, the rest still build
            continue
        module_doc = _doc(module)
        if _fits(module_doc):
            buckets["instruction"].append({
                "prompt": f"Describe the Python standard-library module `{module_name}`.",
                "answer": module_doc, "source": f"{module_name}:",
            })
        for name, obj in _own_members(module):
            source = f"{module_name}:{name}"
            doc = _doc(obj)
            if inspect.isclass(obj):
                if _fits(doc):
                    buckets["instruction"].append({
                        "prompt": f"Explain what the class `{module_name}.{name}` is for.",
                        "answer": doc, "source": source,
                    })
                continue
            if _fits(doc):
                buckets["qa"].append({
                    "prompt": f"Question: In Python's `{module_name}` module, what does "
                              f"`{name}{_signature(obj)}` do?\nAnswer:",
                    "answer": doc, "source": source,
                })
            try:
                code = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if doc and _fits(code):
                summary = doc.split("\n\n")[0]
                buckets["code"].append({
                    "prompt": f"Write the Python function `{name}{_signature(obj)}` of the `{module_name}` "
                              f"module.\n{summary}",
                    "answer": textwrap.dedent(code).strip(), "source": source,
                })
    return {name: _spread(records, BUCKET_SIZES[name]) for name, records in buckets.items()}


def _spread(records: list[dict[str, str]], size: int) -> list[dict[str, str]]:
    """At most ``size`` records taken evenly across the list, so every module contributes, not only the first."""
    if len(records) <= size:
        return records
    return [records[i * len(records) // size] for i in range(size)]


def write_corpus(out: Path) -> dict[str, int]:
    """Write ``{bucket}.jsonl`` and ``SOURCES.md`` into ``out``; returns the record count per bucket."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    with warnings.catch_warnings():  # reading every module attribute touches deprecated aliases (typing.re)
        warnings.simplefilter("ignore", DeprecationWarning)
        buckets = build_records()
    for name, records in buckets.items():
        write_bucket(out / f"{name}.jsonl", records)
        counts[name] = len(records)
    (out / "SOURCES.md").write_text(LICENCE.format(
        version=platform.python_version(), implementation=platform.python_implementation(),
        platform=sys.platform,
    ), encoding="utf-8")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OFFLINE_CORPUS_DIR)
    args = parser.parse_args(argv)
    counts = write_corpus(args.out)
    print(f"wrote {counts} to {args.out}")


if __name__ == "__main__":
    main()
