"""The tool-call format (issue 35): how tools and calls are written in a prompt, the grammar a constrained call
is decoded under, and how a response's text is read back into calls.

**One format, Hermes/Qwen2.5's.** A call is written as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and several calls follow each other separated by one newline. It is the format Qwen2.5's chat template (the
base of Dream) and the Hermes function-calling models were trained on, and it has a marker that opens every call,
so a response either is calls or is text from its first token. The checkpoints served here (LLaDA's, Dream's, the
embedded model's and the LLaDA2 test checkpoint's templates) know no tools and have no call markup of their own; for them :func:`generic_turns` renders a conversation with tools
into plain turns (the tools listed in the system turn as Qwen2.5's template lists them, assistant calls in the
format above, tool results as a user turn of ``<tool_response>`` blocks). A checkpoint whose chat template takes
``tools`` renders them itself (`service.engine.prompts.encode_chat`); the calls are still decoded and read in
this format.

**The grammar** (:func:`call_grammar`, llguidance's Lark syntax with ``%json`` for each function's arguments):

* ``required``: one call, or with parallel calls one or more, each naming one of the tools, its arguments
  following that function's JSON schema (written as `service.engine.grammar.JSON_OPTIONS` writes JSON: fixed
  separators, so the punctuation is forced and costs no forward);
* a named function: the same with only that function;
* ``auto``: either the calls above, or text that does not start with ``<tool_call>``. The choice is made by the
  response's first tokens under the model's own probabilities (the marker's first token against any other);
  once a call starts, it is constrained to the end, so no call can come out malformed. The alternative, decoding
  unconstrained and parsing whatever markers appear, would let a diffusion model (which reveals positions out of
  order) write a call whose JSON is broken, returned as text; this costs a left-to-right reveal of the text answer
  (`service.engine.grammar`: the chain still reveals several positions per forward where the model is confident).

**Reading calls** (:func:`parse_calls`): a response that is whole calls gives them; a response cut inside a call
(by ``max_tokens``) gives the calls completed before the cut, never a partial one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service import strict_json
from service.engine.grammar import JSON_OPTIONS

#: The markers around one call in a response, and around one tool result in a prompt.
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"
#: Between two calls of one response.
CALL_SEPARATOR = "\n"

#: The system text that lists the tools (worded as Qwen2.5's chat template words it, without its "# Tools"
#: heading); ``{tools}``: one JSON line per tool.
TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class Function:
    """One tool a request offers: its ``name``, ``description`` and JSON schema of its arguments (``parameters``,
    an object or a boolean; absent in the request: any JSON object)."""

    name: str
    description: str | None
    parameters: dict[str, Any] | bool

    def declared(self) -> dict[str, Any]:
        """The tool as OpenAI's request spells it (what a chat template that knows tools reads)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Call:
    """One call read from a response: the function's ``name`` and its ``arguments`` as compact JSON text."""

    name: str
    arguments: str


def call_text(name: str, arguments: str) -> str:
    """One call in the format (``arguments``: the JSON text of an object)."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CALL_CLOSE}'


def generic_turns(turns: Sequence[dict[str, Any]], functions: Sequence[Function]) -> list[dict[str, str]]:
    """A conversation with tools as plain ``{"role", "content"}`` turns for a chat template that knows no tools.

    Args:
        turns: messages as dicts: ``role`` (system, user, assistant, tool), ``content`` (str), and on assistant
            turns optionally ``tool_calls`` (``[{"name", "arguments"}]``, arguments as JSON text).
        functions: the request's tools (none: no tools section).

    Returns: the turns, the tools listed in the first system turn (one added when there is none), each assistant
    turn's calls after its text, and each run of tool turns merged into one user turn of ``<tool_response>``
    blocks (Qwen2.5's template does so).
    """
    out: list[dict[str, str]] = []
    for turn in turns:
        role, content = turn["role"], turn.get("content") or ""
        if role == "tool":
            block = f"{RESULT_OPEN}{content}{RESULT_CLOSE}"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        calls = turn.get("tool_calls") or ()
        if calls:
            written = CALL_SEPARATOR.join(call_text(c["name"], c["arguments"]) for c in calls)
            content = f"{content}\n{written}" if content else written
        out.append({"role": role, "content": content})
    for turn in out:
        turn.pop("_tool", None)
    if functions:
        listed = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(f.declared(), ensure_ascii=False)
                                                       for f in functions))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listed}" if out[0]["content"] else listed}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def call_grammar(functions: Sequence[Function], parallel: bool, text_allowed: bool) -> str:
    """llguidance's Lark grammar of a response that is calls of ``functions`` (one, or with ``parallel`` one or
    more), or with ``text_allowed`` also any text not starting with the call marker (module docstring).

    The grammar is not yet checked (`service.engine.grammar.GrammarCompiler` compiles it, bounded)."""
    lines = []
    for i, f in enumerate(functions):
        schema = f.parameters
        if schema is True or schema == {}:
            schema = {"type": "object"}
        elif schema is False:
            schema = {"not": {}}
        # Written as the structured-output path writes JSON: llguidance reads the options from "x-guidance".
        nested = json.dumps({"type": "object", **schema, "x-guidance": JSON_OPTIONS}, separators=(",", ":"))
        head = json.dumps(f'{{"name": {json.dumps(f.name)}, "arguments": ')
        lines.append(f"fn_{i}: {head} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {nested}")
    names = " | ".join(f"fn_{i}" for i in range(len(functions)))
    calls = f"call ({json.dumps(CALL_SEPARATOR)} call)*" if parallel else "call"
    start = f"start: calls | TEXT\nTEXT: /(.|\\n)*/ & ~/{_regex(CALL_OPEN)}(.|\\n)*/" if text_allowed else \
        "start: calls"
    return "\n".join([start, f"calls: {calls}",
                      f"call: {json.dumps(CALL_OPEN)} ({names}) {json.dumps(CALL_CLOSE)}", *lines]) + "\n"


def _regex(text: str) -> str:
    """``text`` as a literal in a Lark regex."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in r"\/.^$*+?()[]{}|" else c) for c in text)


def starts_as_call(text: str) -> bool:
    """True when ``text`` is, or may still become, calls: it starts with the call marker or is a prefix of it (a
    streamed response withholds such text until it knows)."""
    return text.startswith(CALL_OPEN) or CALL_OPEN.startswith(text)


def parse_calls(text: str, max_depth: int = strict_json.MAX_DEPTH) -> tuple[list[Call], bool]:
    """The calls a response's text holds.

    Args:
        text: the response (EOS and stop strings already cut).
        max_depth: most nesting of a call's JSON (each call's JSON is parsed by `service.strict_json.loads`, which
            refuses deeper nesting before Python's recursion could).

    Returns: (calls, complete): the calls in order, every one whole; ``complete`` is True when the text is exactly
    those calls, False when it stops inside one (a ``max_tokens`` cut: the partial call is not returned) or does
    not start with the call marker (then no calls).
    """
    calls: list[Call] = []
    at = 0
    while text.startswith(CALL_OPEN, at):
        end = text.find(CALL_CLOSE, at + len(CALL_OPEN))
        if end < 0:
            return calls, False
        body = text[at + len(CALL_OPEN):end]
        try:
            value = strict_json.loads(body, max_depth=max_depth)
        except strict_json.JSONError:
            value = None
        if value is None:
            call = _written_call(body)  # nested deeper, or an integer longer, than parsing takes
            if call is None:
                return calls, False
            calls.append(call)
        elif not (isinstance(value, dict) and isinstance(value.get("name"), str)
                  and isinstance(value.get("arguments"), dict)):
            return calls, False
        else:
            calls.append(Call(value["name"], json.dumps(value["arguments"], ensure_ascii=False)))
        at = end + len(CALL_CLOSE)
        if at == len(text):
            return calls, True
        if not text.startswith(CALL_SEPARATOR, at):
            return calls, False
        at += len(CALL_SEPARATOR)
    return calls, False  # no marker at the start, or a separator with no call after it


#: A call as the grammar writes it (`JSON_OPTIONS`' separators, the name first): its name and its arguments' text.
_WRITTEN_CALL = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (\{.*\})\}', re.DOTALL)
# One lexical token of JSON text (strings whole, so their brackets are not counted).
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|[^"\[\]{}]+')


def _written_call(body: str) -> Call | None:
    """A call whose JSON the server will not parse into values (nested deeper than `service.strict_json.MAX_DEPTH`,
    an integer of more digits than Python converts) read from its text instead (issue 45, N5: such a call, valid
    under its grammar, was dropped: no ``tool_calls``, ``finish_reason`` ``stop``). The grammar wrote it, so it has
    the shape of :data:`_WRITTEN_CALL`; its arguments are returned as written (the separators json.dumps writes)
    once a bracket count, linear and without recursion, finds them one balanced object. None otherwise."""
    match = _WRITTEN_CALL.fullmatch(body)
    if match is None:
        return None
    depth = 0
    for token in _JSON_TOKEN.findall(match.group(2)):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(token, 0)
        if depth < 0:
            return None
    return Call(json.loads(match.group(1)), match.group(2)) if depth == 0 else None


__all__ = ["CALL_CLOSE", "CALL_OPEN", "TOOLS_PREAMBLE", "Call", "Function", "call_grammar", "call_text",
           "generic_turns", "parse_calls", "starts_as_call"]
