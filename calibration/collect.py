"""``collect``: build the paper's calibration buckets from public datasets (needs ``datasets`` and a network).

Paper, "Experimental Setup": "The default collection script saves 1000 C4 records, 500 UltraChat records, 300
ARC records, and 200 CodeSearchNet records with a minimum length filter." Sources are mapped to the
``mixed_chat`` buckets (schema in :mod:`calibration.corpus`) as follows; the mapping is ours, the paper does not
spell it out:

* ``instruction``: UltraChat (first user turn -> first assistant turn) and C4 (a document's first sentence as the
  prompt "Continue the text: ...", the rest as the answer);
* ``qa``: ARC (Challenge and Easy; question with lettered choices -> "label. text" of the key);
* ``code``: CodeSearchNet-Python (docstring -> function code).

Hosts without a network use the shipped offline corpus (:mod:`calibration.offline_corpus`) instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from calibration.corpus import write_bucket

#: (dataset id, config, split, records kept, bucket) as in the paper's default collection.
SOURCES: tuple[tuple[str, str | None, str, int, str], ...] = (
    ("allenai/c4", "en", "validation", 1000, "instruction"),
    ("HuggingFaceH4/ultrachat_200k", None, "train_sft", 500, "instruction"),
    ("allenai/ai2_arc", "ARC-Challenge", "train", 300, "qa"),
    ("code-search-net/code_search_net", "python", "train", 200, "code"),
)
MIN_ANSWER_CHARS = 200


class CollectError(RuntimeError):
    """``collect`` cannot run here (no ``datasets`` package, no network); the message says what to do."""


def _c4(row: dict[str, Any]) -> tuple[str, str] | None:
    text = row["text"].strip()
    head, _, rest = text.partition(". ")
    return (f"Continue the text: {head}.", rest) if rest else None


def _ultrachat(row: dict[str, Any]) -> tuple[str, str] | None:
    messages = row["messages"]
    if len(messages) < 2 or messages[0]["role"] != "user" or messages[1]["role"] != "assistant":
        return None
    return messages[0]["content"], messages[1]["content"]


def _arc(row: dict[str, Any]) -> tuple[str, str] | None:
    choices = row["choices"]
    lines = [f"{label}. {text}" for label, text in zip(choices["label"], choices["text"])]
    key = choices["label"].index(row["answerKey"]) if row["answerKey"] in choices["label"] else None
    if key is None:
        return None
    prompt = f"Question: {row['question']}\n" + "\n".join(lines) + "\nAnswer:"
    return prompt, f"{choices['label'][key]}. {choices['text'][key]}"


def _code_search_net(row: dict[str, Any]) -> tuple[str, str] | None:
    doc, code = row.get("func_documentation_string", ""), row.get("whole_func_string", "")
    name = row.get("func_name", "")
    return (f"Write the Python function `{name}`.\n{doc.strip()}", code) if doc and code else None


_CONVERTERS: dict[str, Callable[[dict[str, Any]], tuple[str, str] | None]] = {
    "allenai/c4": _c4,
    "HuggingFaceH4/ultrachat_200k": _ultrachat,
    "allenai/ai2_arc": _arc,
    "code-search-net/code_search_net": _code_search_net,
}


def convert(dataset_id: str, rows: Iterable[dict[str, Any]], limit: int,
            min_chars: int = MIN_ANSWER_CHARS) -> Iterator[dict[str, str]]:
    """Turn a dataset's rows into bucket records (``prompt``, ``answer``, ``source``), at most ``limit``,
    skipping rows the converter rejects or whose answer is shorter than ``min_chars`` (the length filter).

    ARC answers are short by nature, so for ``allenai/ai2_arc`` the filter applies to prompt + answer.
    """
    converter = _CONVERTERS[dataset_id]
    kept = 0
    for row in rows:
        if kept >= limit:
            return
        pair = converter(row)
        if pair is None:
            continue
        prompt, answer = pair
        measured = prompt + answer if dataset_id == "allenai/ai2_arc" else answer
        if len(measured) < min_chars:
            continue
        kept += 1
        yield {"prompt": prompt, "answer": answer, "source": dataset_id}


def collect(out: str | Path, sources=SOURCES) -> dict[str, int]:
    """Download (streaming) and write ``{bucket}.jsonl`` into ``out``; returns records per bucket.

    Raises:
        CollectError: ``datasets`` is not installed, or a source cannot be reached (message names it and
            points to the offline corpus).
    """
    try:
        import datasets  # optional: only hosts with internet run collect
    except ImportError as error:
        raise CollectError(
            "collect needs the 'datasets' package and internet access (pip install 'dllm-kvq[collect]'); "
            "without them use the shipped offline corpus (calibration/data/offline)"
        ) from error
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buckets: dict[str, list[dict[str, str]]] = {}
    for dataset_id, config, split, limit, bucket in sources:
        try:
            rows = datasets.load_dataset(dataset_id, config, split=split, streaming=True)
            records = list(convert(dataset_id, rows, limit))
        except Exception as error:  # network and hub errors come in many types; all mean "cannot collect here"
            raise CollectError(
                f"cannot read {dataset_id} ({config}, {split}): {error}. collect needs internet access; "
                f"without it use the shipped offline corpus (calibration/data/offline)"
            ) from error
        buckets.setdefault(bucket, []).extend(records)
    for bucket, records in buckets.items():
        write_bucket(out / f"{bucket}.jsonl", records)
    return {bucket: len(records) for bucket, records in buckets.items()}
