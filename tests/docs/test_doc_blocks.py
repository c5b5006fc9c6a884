"""Every ```bash and ```python block of README.md and docs/*.md runs as written, so the documentation cannot drift
from the code (issue 17).

The blocks run in one fresh copy of the checkout (the tracked and untracked, not ignored, files; ``.venv`` there is
a link to the venv running this test, which is not on ``PATH``, and ``PYTHONPATH`` points at the copy), pages in
``PAGES`` order and blocks
in page order, so a block may use what an earlier block of its page, or a page it names with ``after=``, wrote.
Every block gets ``DLLM_ADMIN_KEY``, one torch thread and no hub access.

An HTML comment on the line just before a block's opening fence says how it is tested:

- none: the block runs as it is (bash with ``-euo pipefail``, or the venv's python) and must exit 0;
- ``<!-- doc-test: needs=server -->``: it runs while a server started by this test (``dllm-kvq serve`` in the
  copy, with the default store and the admin key) answers; ``127.0.0.1:8000`` and ``localhost:8000`` in the block
  become that server's address;
- ``<!-- doc-test: skip=<what> <reason> -->``: listed and skipped with the reason (``gpu``, ``hub``, ``docker``,
  ``kubernetes``, ``network``, ``long`` ...);
- ``<!-- doc-test: quickstart -->``: a quickstart step (docs/quickstart.md), run end to end by ``examples/quickstart.sh`` in
  tests/e2e; here each command of the block must be one the script runs: the same program and
  subcommand (``.venv/bin/dllm-kvq calibrate`` is ``$PY -m calibration``) with at least the same flags (the
  script takes the port, store and folders from its environment, so values may differ);
- ``<!-- doc-test: covered=<test file> <reason> -->``: another test runs the block (it reads it from the page);
  here the test file must exist and name the page.

A page says which page must run before it with ``<!-- doc-test: after=calibration.md -->`` anywhere in its text.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
ADMIN_KEY = "doc-test-admin-key-0123456789"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>bash|python)\s*$")
MARK = re.compile(r"<!--\s*doc-test:\s*(?P<kind>[a-z]+)(?:=(?P<value>\S+))?\s*(?P<reason>.*?)\s*-->")
AFTER = re.compile(r"<!--\s*doc-test:\s*after=(?P<page>\S+)\s*-->")
LOCAL = re.compile(r"(?:127\.0\.0\.1|localhost):8000")
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, first line (1-based), language, text, and the doc-test mark before it."""

    page: str
    line: int
    lang: str
    text: str
    kind: str = "run"
    value: str = ""
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str) -> list[Block]:
    """The bash and python blocks of a page, with the mark of the line before each (indentation removed)."""
    lines = (REPO / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence["indent"]), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        mark = MARK.search(lines[start - 1]) if start else None
        kind, value, reason = (mark["kind"], mark["value"] or "", mark["reason"]) if mark else ("run", "", "")
        found.append(Block(page, start + 1, fence["lang"], "\n".join(body) + "\n", kind, value, reason))
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks_of(page)]


def test_every_block_has_a_known_mark():
    unknown = [f"{b.name}: {b.kind}" for b in ALL if b.kind not in ("run", "needs", "skip", "quickstart", "covered")]
    assert unknown == []
    assert all(b.value == "server" for b in ALL if b.kind == "needs")
    assert all(b.value and b.reason for b in ALL if b.kind in ("skip", "covered")), "a skip names what and why"


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "skip"], ids=lambda b: b.name)
def test_skipped_block(block):
    pytest.skip(f"needs {block.value}: {block.reason}")


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "covered"], ids=lambda b: b.name)
def test_covered_block_is_read_by_its_test(block):
    test_file = REPO / block.value
    assert test_file.is_file(), f"{block.name}: {block.value} does not exist"
    assert Path(block.page).name in test_file.read_text(), f"{block.value} does not read {block.page}"


LINK = re.compile(r"\[[^\]]+\]\((?P<target>[^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    """Every relative link of a page names a file of the repository and, with ``#``, one of its headings."""
    broken = []
    for target in LINK.findall((REPO / page).read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / page).parent / path if path else REPO / page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = [slug(line.lstrip("#")) for line in file.read_text().splitlines() if line.startswith("#")]
            if anchor not in headings:
                broken.append(target)
    assert broken == []


# ---- what every page's commands look like ----------------------------------------------------------------------

# A command that needs the venv, spelled without it: ``python -m ...``, ``python x.py``, ``dllm-kvq serve`` ...
BARE = re.compile(r"(?<![\w./-])(?:python3?|dllm-kvq)\s+(?:-m\s|(?:serve|generate|policies|calibrate|evaluate)\b|"
                  r"[\w./-]+\.py\b)")


@pytest.mark.parametrize("page", PAGES)
def test_commands_name_the_venv_programs(page):
    """Prose and blocks alike write ``.venv/bin/python`` and ``.venv/bin/dllm-kvq``: a bare ``python -m ...``
    fails with ModuleNotFoundError unless the venv is active, and the README's rule is that nothing needs that."""
    text = (REPO / page).read_text()
    bare = [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in BARE.finditer(text)]
    assert bare == []


@pytest.mark.parametrize("page", PAGES)
def test_curl_shows_failures(page):
    """``curl -s`` alone hides a refused request and sends an empty body for a missing ``--data @file``: every curl
    command of a page is ``-sS --fail-with-body``."""
    calls = [line for b in blocks_of(page) for line in b.text.splitlines() if re.match(r"\s*curl\s", line)]
    assert [c for c in calls if not re.match(r"\s*curl -sS --fail-with-body\s", c)] == []


def held_out_questions() -> dict[str, str]:
    """Prompt -> answer of the embedded model's held-out test split."""
    import json

    lines = (REPO / "service/assets/embedded/task/test.jsonl").read_text().splitlines()
    return {q["prompt"]: q["answer"] for q in map(json.loads, lines)}


# A quoted prompt of the embedded model's task: an instruction, a colon, then digits.
TASK_PROMPT = re.compile(r"""["'](?P<prompt>[a-z][a-z ,]*\d*[a-z ,]*:(?: \d)+)["']""")


@pytest.mark.parametrize("page", PAGES)
def test_task_prompts_are_held_out_questions_with_their_answer(page):
    """A prompt for the embedded model is a real instance of its task (48 digits; ``next: 1 2 3`` gives junk) taken
    from the held-out split, and the page states its right answer."""
    text = (REPO / page).read_text()
    flat = " ".join(text.split())
    questions = held_out_questions()
    for m in TASK_PROMPT.finditer(text):
        prompt = m["prompt"]
        assert prompt in questions, f"{page}: {prompt!r} is not a held-out question of the embedded model's task"
        assert questions[prompt] in flat, f"{page}: the answer to {prompt!r} ({questions[prompt]}) is not stated"


# ---- quickstart: the README's commands are the script's -------------------------------------------------------

# The console command's subcommands and what the script runs for them (`dllm_kvq/cli.py`).
CONSOLE = {"serve": ["-m", "service", "serve"], "generate": ["-m", "service", "generate"],
           "policies": ["-m", "service", "policies"], "calibrate": ["-m", "calibration"],
           "evaluate": ["-m", "evaluation"]}


def commands(text: str) -> list[list[str]]:
    """Shell commands of a text as token lists (continuations joined, comments and redirections dropped)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        tokens = [t for t in shlex.split(line) if t not in ("&", "2>&1") and not t.startswith((">", "$(", "|"))]
        out.append(tokens)
    return out


def signature(tokens: list[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """(program and subcommands, flags) of a command; the console command as the `python -m` form."""
    if tokens[0].endswith("/dllm-kvq") or tokens[0] == "dllm-kvq":
        tokens = ["$PY", *CONSOLE[tokens[1]], *tokens[2:]]
    elif tokens[0].endswith("/python"):
        tokens = ["$PY", *tokens[1:]]
    head = []
    for t in tokens:
        if t.startswith("-") and t != "-m":
            break
        head.append(t)
    flags = set()
    for t in tokens[len(head):]:
        if re.fullmatch(r"-[a-zA-Z]{2,}", t):
            flags |= {f"-{c}" for c in t[1:]}  # -sf is -s -f
        elif t.startswith("-"):
            flags.add(t.split("=", 1)[0])
    # The script's URLs and paths are variables: compare the program words that are not values.
    return tuple(h for h in head if "/" not in h.strip("\"'") or h in ("examples/ask.py", "examples/kv_metrics.py")
                 ), frozenset(flags)


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "quickstart"], ids=lambda b: b.name)
def test_quickstart_block_is_run_by_the_quickstart_script(block):
    script = [signature(c) for c in commands((REPO / "examples" / "quickstart.sh").read_text())]
    for tokens in commands(block.text):
        head, flags = signature(tokens)
        matches = [f for h, f in script if h == head]
        assert matches, f"{block.name}: examples/quickstart.sh never runs {' '.join(head)}"
        assert any(flags <= f for f in matches), (
            f"{block.name}: examples/quickstart.sh runs {' '.join(head)} without {sorted(flags - max(matches, key=len))}")


# ---- running the blocks -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A fresh copy of the checkout: tracked and untracked files that git does not ignore, and a .venv link."""
    root = tmp_path_factory.mktemp("doc-blocks") / "dllm-kvq"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    (root / ".venv").symlink_to(Path(sys.prefix))  # the venv running this test
    return root


@pytest.fixture(scope="module")
def env(checkout) -> dict[str, str]:
    # The venv is not on PATH (not activated): a block that says `python` or `dllm-kvq` where it means the venv's
    # fails here as it does for a reader who has not activated it.
    bin_dir = os.path.realpath(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if os.path.realpath(p) != bin_dir)
    return {**os.environ, "PATH": path, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1",
            "DLLM_ADMIN_KEY": ADMIN_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(checkout, env, tmp_path_factory):
    """Started on first use: ``.venv/bin/dllm-kvq serve`` in the copy (its default store, the admin key), on a free
    port; its root URL. Stopped (SIGTERM, it drains) at the end."""
    started: dict[str, subprocess.Popen] = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("server") / "server.log"

    def get() -> str:
        if "proc" not in started:
            with open(log_path, "wb") as log:
                started["proc"] = proc = subprocess.Popen(
                    [str(checkout / ".venv/bin/dllm-kvq"), "serve", "--port", str(port), "--threads", "1"],
                    cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                assert proc.poll() is None, f"server exited {proc.returncode}: {log_path.read_text()[-3000:]}"
                try:
                    if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            raise AssertionError(f"server not ready after 300 s: {log_path.read_text()[-3000:]}")
        return url

    yield get
    if "proc" in started:
        started["proc"].terminate()
        started["proc"].wait(timeout=60)


def run_block(block: Block, checkout: Path, env: dict[str, str], url: str | None) -> None:
    text = LOCAL.sub(url.removeprefix("http://"), block.text) if url else block.text
    argv = ["bash", "-euo", "pipefail", "-c", text] if block.lang == "bash" else [str(checkout / ".venv/bin/python"),
                                                                                  "-c", text]
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, (f"{block.name} exited {done.returncode}\n--- block\n{text}--- stdout (end)\n"
                                  f"{done.stdout[-3000:]}\n--- stderr (end)\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def run_page(checkout, env, server):
    done: set[str] = set()

    def run(page: str) -> None:
        if page in done:
            return
        done.add(page)
        for before in AFTER.findall((REPO / page).read_text()):
            run(str(Path(page).parent / before))
        for block in blocks_of(page):
            if block.kind in ("run", "needs"):
                run_block(block, checkout, env, server() if block.kind == "needs" else None)

    return run


# Only this test starts processes (the blocks, a server); the checks above read the pages (the fast tier).
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.kind in ("run", "needs") for b in blocks_of(p))])
def test_page_blocks_run(page, run_page):
    run_page(page)


@pytest.mark.integration
def test_readme_first_request_answers_as_shown(checkout, env, tmp_path):
    """The README's first request (its first ``needs=server`` block, a curl) sent to a fresh server on the embedded
    model gives the answer the README's next ```json block shows: the same message, finish reason, usage and KV
    configuration (``id`` and ``created`` differ from run to run). Its own server on a new store: the shared one
    may serve what other pages activated."""
    import json

    from tests.support.processes import ServerProcess

    text = (REPO / "README.md").read_text()
    first = next(b for b in blocks_of("README.md") if b.kind == "needs")
    assert first.lang == "bash" and first.text.lstrip().startswith("curl "), first.name
    after = text.split(first.text, 1)[1]
    shown = json.loads(re.search(r"```json\n(?P<body>.*?)\n```", after, re.DOTALL)["body"])
    srv = ServerProcess({"DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_THREADS": "1"},
                        log_path=tmp_path / "server.log").start(timeout_s=180)
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", LOCAL.sub(srv.url.removeprefix("http://"), first.text)],
                              cwd=checkout, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                              check=False)
    finally:
        srv.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert [c["message"] for c in got["choices"]] == [c["message"] for c in shown["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in shown["choices"]]
    assert got["usage"] == shown["usage"] and got["kv_config"] == shown["kv_config"]
