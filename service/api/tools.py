"""Tool calling on ``/v1/chat/completions`` (issue 35): OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, the conversation's calls and results, and the calls of a response.

``POST /tokenize`` takes ``tools`` too (:class:`OfferedTools`, vLLM's shape), checked and rendered as chat renders
them, so its ids are the prompt chat completions decodes from.

The format, its grammar and its parser are `service.engine.tool_format`'s; here are the request's shapes and
limits, what a request asks for (:class:`ToolRequest`), and the response's ``tool_calls``.

Limits (each refusal a 400 naming the field):

* ``tools``: 1 to `MAX_TOOLS` (OpenAI's 128) tools of type ``function``; a name is 1-64 letters, digits,
  ``_`` or ``-`` (OpenAI's rule), unique in the request; ``parameters`` a JSON Schema object of at most
  `MAX_PARAMETERS_BYTES` as compact JSON, whose ``type`` (if given) is ``object`` (calls carry an object of
  arguments); a schema no finite value satisfies, or over the grammar size limit (counted as when sent in
  ``response_format``, issue 45), is refused as a structured-output schema is;
* ``tool_choice``: ``none``, ``auto`` (default with tools), ``required`` or ``{"type": "function", "function":
  {"name"}}`` naming one of ``tools``; other than ``none`` only with ``tools``, and not together with a
  structured-output field (``response_format`` other than text, ``structured_outputs``, ``guided_*``): the response
  is calls, or (``auto``) text or calls, and one grammar says which;
* a conversation's assistant ``tool_calls``: ``function.arguments`` is the JSON text of an object (at most
  `MAX_ARGUMENTS_BYTES`, nested at most `service.strict_json.MAX_DEPTH`); a ``tool`` message has a
  ``tool_call_id`` and content.

``strict``: ``true`` checks ``parameters`` as OpenAI's strict mode does (`service.api.strict_schema`: every object
``additionalProperties: false`` with every property required, only the keywords strict mode supports; absent
``parameters``: no arguments, ``{}``), a 400 naming ``tools.{i}.function.parameters`` otherwise, and the arguments
are decoded exactly. Not strict, the schema is any JSON Schema object and is enforced as given (OpenAI then only
tries to follow it; here the grammar holds it): keys it does not forbid may appear, as the schema allows.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from service import strict_json
from service.api.strict_schema import check_strict, strict_parameters
from service.engine.errors import EngineInputError
from service.engine.grammar import GrammarSpec
from service.engine.schema_values import has_finite_value
from service.engine.tool_format import CALL_OPEN, Call, Function, call_grammar, parse_calls

#: Most tools one request may offer (OpenAI's limit).
MAX_TOOLS = 128
#: Largest ``parameters`` schema of one function, in bytes of its compact JSON (the whole grammar is further
#: bounded by `service.engine.grammar.MAX_SOURCE_BYTES`).
MAX_PARAMETERS_BYTES = 64 * 1024
#: Largest ``function.arguments`` text of one call in a conversation, in bytes.
MAX_ARGUMENTS_BYTES = 64 * 1024
#: OpenAI's rule for a function's name.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"

FunctionName = Annotated[StrictStr, Field(pattern=NAME_PATTERN, description="1-64 letters, digits, _ or -")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    """One function a request offers (OpenAI's ``tools[].function``)."""

    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments (an object); "
                                              "absent: any JSON object")
    strict: StrictBool | None = None


class ToolDefinition(_Strict):
    """OpenAI's ``tools[]`` item (only functions)."""

    type: Literal["function"]
    function: FunctionDefinition


class _NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the response is a call of it."""

    type: Literal["function"]
    function: _NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ToolDefinition], Field(min_length=1, max_length=MAX_TOOLS)]


class CalledFunction(_Strict):
    """A call's function: its name and arguments (JSON text of an object)."""

    name: StrictStr
    arguments: StrictStr


class ToolCallIn(_Strict):
    """A call in an assistant message of the conversation (OpenAI's shape)."""

    id: StrictStr
    type: Literal["function"]
    function: CalledFunction


class OfferedTools(BaseModel):
    """The ``tools`` field: the functions a chat request offers, which the chat template renders into the prompt.
    Mixed into ``/v1/chat/completions``' request (through :class:`ToolFields`) and ``/tokenize``'s (vLLM's
    ``TokenizeChatRequest`` takes ``tools``), so both render the same prompt."""

    tools: Tools | None = Field(None, description=f"functions the model may call (1-{MAX_TOOLS})")

    def offered(self) -> tuple[Function, ...]:
        """The offered functions as the prompt lists them (none: an empty tuple), checked.

        Raises:
            EngineInputError: a limit of the module docstring on ``tools``, naming the field.
        """
        return tuple(_offered(self.tools or ())[0])


def _offered(tools: list[ToolDefinition] | tuple[()]) -> tuple[list[Function], dict[str, int]]:
    """Each tool as a `Function` (a strict one's parameters as strict mode reads them), and each name's index."""
    functions = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        f = tool.function
        field = f"tools.{i}.function"
        if f.name in seen:
            raise EngineInputError(f"{field}.name {f.name!r} is also tools.{seen[f.name]}'s: names must be "
                                   "unique", f"{field}.name")
        seen[f.name] = i
        parameters = f.parameters
        if f.strict:
            check_strict(parameters, f"{field}.parameters", f.name)
            parameters = strict_parameters(parameters)
        functions.append(Function(f.name, f.description, _parameters(parameters, f"{field}.parameters")))
    return functions, seen


class ToolFields(OfferedTools):
    """The tool fields of ``/v1/chat/completions`` (module docstring). Mixed into its request model."""

    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, or "
                                           '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: StrictBool | None = Field(None, description="with tool_choice required or auto, allow "
                                                   "several calls in one response (default true)")

    def tool_request(self, constrained: str | None) -> ToolRequest | None:
        """What the request's tool fields ask for (None: no tools and no ``tool_choice``).

        Args:
            constrained: the structured-output field the request also gives, or None.

        Raises:
            EngineInputError: a limit of the module docstring, naming the field.
        """
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise EngineInputError("tool_choice other than none needs tools", "tool_choice")
            return None
        functions, seen = _offered(self.tools)
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in seen:
                raise EngineInputError(f"tool_choice names {choice.function.name!r}, which is not one of tools",
                                       "tool_choice.function.name")
            called = [functions[seen[choice.function.name]]]
            mode = "named"
        else:
            mode = choice or "auto"
            called = functions
        if mode != "none" and constrained is not None:
            raise EngineInputError(f"{constrained} cannot be combined with tools unless tool_choice is none: the "
                                   "response is then calls (or text or calls), under one grammar", constrained)
        return ToolRequest(tuple(functions), tuple(called), mode, self.parallel_tool_calls is not False,
                           tuple(f"tools.{seen[f.name]}.function.parameters" for f in called))


def _parameters(schema: dict[str, Any] | None, field: str) -> dict[str, Any]:
    if schema is None:
        return {"type": "object"}
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > MAX_PARAMETERS_BYTES:
        raise EngineInputError(f"{field} is {size:,} bytes as JSON, over the {MAX_PARAMETERS_BYTES:,} bytes a "
                               "function's parameters may have", field)
    kind = schema.get("type", "object")
    if kind != "object":
        raise EngineInputError(f"{field} must be an object schema (type object): a call's arguments are a JSON "
                               f"object, got type {json.dumps(kind)}", field)
    if not has_finite_value(schema):
        raise EngineInputError(f"{field} allows no arguments: no finite JSON value satisfies it", field)
    return schema


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and how it may call them.

    Attributes:
        functions: every tool offered (what the prompt lists); called: the ones a call may name (one, for a named
            ``tool_choice``); mode: ``none``, ``auto``, ``required`` or ``named``; parallel: several calls allowed;
        fields: the request field of each called function's ``parameters``.
    """

    functions: tuple[Function, ...]
    called: tuple[Function, ...]
    mode: str
    parallel: bool
    fields: tuple[str, ...] = ()

    @property
    def calls(self) -> bool:
        """True when the response is read for calls (every mode but ``none``)."""
        return self.mode != "none"

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar of the response (None for ``none``: the tools are listed, nothing is constrained)."""
        if not self.calls:
            return None
        return GrammarSpec.lark(call_grammar(self.called, self.parallel, self.mode == "auto"), "tools",
                                self.parameter_specs())

    def parameter_specs(self) -> list[GrammarSpec]:
        """Each called function's ``parameters`` as a structured-output schema naming its field: compiled one by
        one when the whole grammar is refused, to say which schema is at fault."""
        return [GrammarSpec.json_schema({"type": "object", **f.parameters}, field)
                for f, field in zip(self.called, self.fields, strict=True)]


def conversation_calls(calls: list[ToolCallIn] | None, field: str) -> list[dict[str, str]]:
    """An assistant message's ``tool_calls`` as ``[{"name", "arguments"}]``, each ``arguments`` checked to be
    the JSON text of an object, bounded in size and depth before it is parsed.

    Raises:
        EngineInputError: naming ``{field}.{j}.function.arguments``.
    """
    out = []
    for j, call in enumerate(calls or ()):
        where = f"{field}.{j}.function.arguments"
        text = call.function.arguments
        if len(text.encode()) > MAX_ARGUMENTS_BYTES:
            raise EngineInputError(f"{where} is over the {MAX_ARGUMENTS_BYTES:,} bytes a call's arguments may "
                                   "have", where)
        try:
            value = strict_json.loads(text)
        except strict_json.JSONError as exc:
            raise EngineInputError(f"{where} is not acceptable JSON: {exc}", where) from None
        if not isinstance(value, dict):
            raise EngineInputError(f"{where} must be the JSON text of an object", where)
        out.append({"id": call.id, "name": call.function.name, "arguments": json.dumps(value, ensure_ascii=False)})
    return out


def call_id() -> str:
    """A call id as OpenAI writes them (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolAnswer:
    """A response read for calls: ``content`` (the text, or None when the response is calls), the whole ``calls``
    (with ids) and the finish reason (``tool_calls`` when the response is complete calls)."""

    content: str | None
    calls: list[tuple[str, Call]]
    finish_reason: str


def read_answer(text: str, finish_reason: str, ids: list[str] | None = None, forced: bool = False) -> ToolAnswer:
    """The response ``text`` (cut, with the cut's ``finish_reason``) read for calls: text that does not start as a
    call is content; calls are returned whole, a partial one never (a ``length`` cut stays ``length``).
    ``ids``: the ids given to calls already streamed, reused in order. ``forced`` (``required`` or a named
    function): the grammar admits calls only, so text cut inside the call marker (``<tool_``) is a partial call,
    never content."""
    if not text.startswith(CALL_OPEN):  # text (under auto, a cut marker included: the call never started)
        return ToolAnswer(None if forced else text, [], finish_reason)
    calls, complete = parse_calls(text)
    ids = list(ids or ())
    ids += [call_id() for _ in range(len(calls) - len(ids))]
    reason = "tool_calls" if complete and finish_reason == "stop" else finish_reason
    return ToolAnswer(None, list(zip(ids, calls, strict=False)), reason)


__all__ = ["MAX_ARGUMENTS_BYTES", "MAX_PARAMETERS_BYTES", "MAX_TOOLS", "NamedToolChoice", "OfferedTools",
           "ToolAnswer", "ToolCallIn", "ToolDefinition", "ToolFields", "ToolRequest", "call_id", "conversation_calls",
           "read_answer"]
