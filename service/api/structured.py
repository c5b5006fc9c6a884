"""Structured-output request fields (issue 26): OpenAI's ``response_format`` and vLLM's extension fields, turned
into the one grammar the engine constrains the reveal with (`service.engine.grammar`).

Accepted on ``/v1/chat/completions`` and ``/v1/completions`` (at most one of them per request; ``response_format``
``{"type": "text"}`` is no constraint):

* ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
  {"name", "description", "schema", "strict"}}`` (OpenAI's shapes; what ``client.chat.completions.parse`` sends
  for a pydantic model). The schema is always enforced, ``strict`` or not; ``strict: true`` also checks it as OpenAI
  does (`service.api.strict_schema`: every object ``additionalProperties: false`` with every property required,
  only strict mode's keywords), a 400 naming ``response_format.json_schema.schema`` otherwise.
* ``structured_outputs``: vLLM's current object (since v0.12 its only form): ``{"json": schema}``,
  ``{"regex": pattern}``, ``{"choice": [strings]}`` or ``{"json_object": true}``; exactly one key. vLLM's other
  keys (``grammar``, ``structural_tag``, ``whitespace_pattern`` ...) are refused as unknown fields.
* ``guided_json``, ``guided_regex``, ``guided_choice``: the names vLLM used before v0.12, for clients written
  against them.

A regex must match the whole response (Rust regex syntax). A schema or regex the engine cannot compile, or that
takes too long, is a 400 naming the field (e.g. ``response_format.json_schema.schema``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from service import strict_json
from service.api.strict_schema import check_strict
from service.engine.errors import EngineInputError
from service.engine.grammar import MAX_SOURCE_BYTES, GrammarSpec

#: A JSON Schema given as an object (or ``true``), or as its JSON text (vLLM accepts both).
SchemaValue = dict[str, Any] | StrictBool | StrictStr
#: The strings of a choice: at least one, none empty.
Choices = Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseFormatText(BaseModel):
    """OpenAI's ``response_format`` of type ``text``: no constraint."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    """OpenAI's JSON mode: the response is one JSON object."""

    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    """OpenAI's ``json_schema`` object: the schema the response follows (absent: any JSON object)."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormatJsonSchema(_Strict):
    """OpenAI's structured outputs: ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of its keys."""

    json_: SchemaValue | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Choices | None = None
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("json", "regex", "choice", "json_object") if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise PydanticCustomError("request_rule", "give exactly one of json, regex, choice and json_object "
                                      "(got {given})", {"given": ", ".join(given) or "none"})
        return self

    def _value(self, key: str) -> Any:
        return self.json_ if key == "json" else getattr(self, key)


#: The request fields that may carry a grammar, in the order a refusal names them.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")


class StructuredOutputFields(BaseModel):
    """The structured-output fields of the OpenAI routes (module docstring). Mixed into their request models."""

    response_format: ResponseFormat | None = Field(
        None, description="text (no constraint), json_object, or json_schema (OpenAI's shapes)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's structured outputs: exactly one of json (a JSON Schema), regex, choice, "
        "json_object")
    guided_json: SchemaValue | None = Field(None, description="vLLM's name before v0.12 for structured_outputs.json")
    guided_regex: StrictStr | None = Field(None, description="vLLM's name before v0.12 for structured_outputs.regex")
    guided_choice: Choices | None = Field(None, description="vLLM's name before v0.12 for structured_outputs.choice")

    @model_validator(mode="after")
    def _at_most_one(self):
        given = [f for f in CONSTRAINT_FIELDS if self._constrains(f)]
        if len(given) > 1:
            raise PydanticCustomError("request_rule", "give at most one of response_format (other than text), "
                                      "structured_outputs, guided_json, guided_regex, guided_choice",
                                      {"param": given[1]})
        return self

    def _constrains(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not isinstance(value, ResponseFormatText)

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar the request asks for, or None.

        Raises:
            EngineInputError: a schema given as text that is not JSON (naming the field).
        """
        rf, so = self.response_format, self.structured_outputs
        if isinstance(rf, ResponseFormatJsonObject):
            return GrammarSpec.json_object("response_format")
        if isinstance(rf, ResponseFormatJsonSchema):
            schema = rf.json_schema.schema_
            field = "response_format.json_schema.schema"
            if rf.json_schema.strict and schema is not None:  # as OpenAI checks it (`service.api.strict_schema`)
                check_strict(schema, field, rf.json_schema.name, "response_format json_schema")
            return GrammarSpec.json_object(field) if schema is None else GrammarSpec.json_schema(schema, field)
        if so is not None:
            if so.json_ is not None:
                return GrammarSpec.json_schema(_schema(so.json_, "structured_outputs.json"), "structured_outputs.json")
            if so.regex is not None:
                return GrammarSpec.regex(so.regex, "structured_outputs.regex")
            if so.choice is not None:
                return GrammarSpec.choice(so.choice, "structured_outputs.choice")
            return GrammarSpec.json_object("structured_outputs.json_object")
        if self.guided_json is not None:
            return GrammarSpec.json_schema(_schema(self.guided_json, "guided_json"), "guided_json")
        if self.guided_regex is not None:
            return GrammarSpec.regex(self.guided_regex, "guided_regex")
        if self.guided_choice is not None:
            return GrammarSpec.choice(self.guided_choice, "guided_choice")
        return None


def _schema(value: dict[str, Any] | bool | str, field: str) -> dict[str, Any] | bool:
    """A schema given as an object, or as its JSON text (vLLM's ``json`` takes both). The text is bounded before it
    is parsed (`service.strict_json.loads_field`: the grammar's size limit, the body's depth limit), so a schema
    nested 100,000 deep as text is a 400 naming ``field`` as it is when sent as an object."""
    if not isinstance(value, str):
        return value
    try:
        parsed = strict_json.loads_field(value, field, MAX_SOURCE_BYTES)
    except strict_json.JSONError as exc:
        raise EngineInputError(str(exc), field) from None
    if not isinstance(parsed, dict | bool):
        raise EngineInputError(f"{field} must be a JSON Schema (an object or a boolean)", field)
    return parsed


__all__ = ["CONSTRAINT_FIELDS", "ResponseFormat", "ResponseFormatJsonObject", "ResponseFormatJsonSchema",
           "ResponseFormatText", "StructuredOutputFields", "StructuredOutputs"]
