"""Request rules declared once: each rule both validates a request model and states itself in its JSON Schema, so
the published document says exactly what the server refuses (issue 13).

* :class:`RuledModel`: a request model whose ``rules`` (cross-field: "give threshold or steps, not both") run after
  field validation and are written into the model's schema as ``allOf`` entries.
* :func:`only`: an OpenAI field this server honours at its neutral values only (``top_p`` = 1, ``best_of`` = 1 ...): the
  annotation names those values (schema and validation alike), any other value is refused saying what is legal.

A refused rule is a pydantic error whose context names the field (``param``), so `service.api.errors` answers a
400 naming it, as for any field error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    GetJsonSchemaHandler,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

NOT_NULL = {"not": {"type": "null"}}
#: Every RuledModel subclass by name (the name of its component in the OpenAPI document), so that the document
#: can restate their rules with the server's defaults (`service.api.openapi`).
RULED: dict[str, type[RuledModel]] = {}


class Cond:
    """A condition on a request: :meth:`holds` on a validated model, :meth:`schema` a JSON Schema that a request
    body satisfies exactly when the condition holds (``defaults``: the server's settings, where they matter)."""

    def holds(self, model: BaseModel) -> bool:
        raise NotImplementedError

    def schema(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def negated(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A JSON Schema satisfied exactly when the condition does not hold."""
        raise NotImplementedError


class Given(Cond):
    """The field is present and not null."""

    def __init__(self, field: str) -> None:
        self.field = field

    def holds(self, model: BaseModel) -> bool:
        return getattr(model, self.field) is not None

    def schema(self, defaults=None) -> dict[str, Any]:
        return {"required": [self.field], "properties": {self.field: NOT_NULL}}

    def negated(self, defaults=None) -> dict[str, Any]:
        return {"properties": {self.field: {"type": "null"}}}


class Is(Cond):
    """The field equals ``value``. Absent or null, it does not, unless ``server_default`` says that absence means
    the server's setting of the same name, which equals ``value`` (only known when the server fills its document
    in; validation then leaves the case to the server's own check)."""

    def __init__(self, field: str, value: Any, server_default: bool = False) -> None:
        self.field, self.value, self.server_default = field, value, server_default

    def holds(self, model: BaseModel) -> bool:
        return getattr(model, self.field) == self.value

    def _absent_holds(self, defaults: Mapping[str, Any] | None) -> bool:
        return self.server_default and defaults is not None and defaults.get(self.field) == self.value

    def schema(self, defaults=None) -> dict[str, Any]:
        if self._absent_holds(defaults):
            return {"properties": {self.field: {"enum": [self.value, None]}}}
        return {"required": [self.field], "properties": {self.field: {"const": self.value}}}

    def negated(self, defaults=None) -> dict[str, Any]:
        if self._absent_holds(defaults):
            return {"required": [self.field], "properties": {self.field: {"not": {"enum": [self.value, None]}}}}
        return {"properties": {self.field: {"not": {"const": self.value}}}}


class IsText(Cond):
    """The field is a string."""

    def __init__(self, field: str) -> None:
        self.field = field

    def holds(self, model: BaseModel) -> bool:
        return isinstance(getattr(model, self.field), str)

    def schema(self, defaults=None) -> dict[str, Any]:
        return {"required": [self.field], "properties": {self.field: {"type": "string"}}}

    def negated(self, defaults=None) -> dict[str, Any]:
        return {"properties": {self.field: {"not": {"type": "string"}}}}


class NullOrHas(Cond):
    """The field is absent or null, or holds an object whose ``inner`` field equals ``value`` (``inner_default``:
    its value when absent)."""

    def __init__(self, field: str, inner: str, value: Any, inner_default: Any) -> None:
        self.field, self.inner, self.value, self.inner_default = field, inner, value, inner_default

    def holds(self, model: BaseModel) -> bool:
        obj = getattr(model, self.field)
        return obj is None or getattr(obj, self.inner) == self.value

    def _has(self) -> dict[str, Any]:
        has: dict[str, Any] = {"type": "object", "properties": {self.inner: {"const": self.value}}}
        return has if self.value == self.inner_default else {**has, "required": [self.inner]}

    def schema(self, defaults=None) -> dict[str, Any]:
        return {"properties": {self.field: {"anyOf": [{"type": "null"}, self._has()]}}}

    def negated(self, defaults=None) -> dict[str, Any]:
        return {"required": [self.field], "properties": {self.field: {"type": "object", "not": self._has()}}}


class Not(Cond):
    """The condition ``cond`` does not hold."""

    def __init__(self, cond: Cond) -> None:
        self.cond = cond

    def holds(self, model: BaseModel) -> bool:
        return not self.cond.holds(model)

    def schema(self, defaults=None) -> dict[str, Any]:
        return self.cond.negated(defaults)

    def negated(self, defaults=None) -> dict[str, Any]:
        return self.cond.schema(defaults)


class Rule:
    """A cross-field rule: ``message`` says what is legal, ``param`` is the field a refusal names."""

    def __init__(self, message: str, param: str) -> None:
        self.message, self.param = message, param

    def ok(self, model: BaseModel) -> bool:
        raise NotImplementedError

    def body(self, defaults: Mapping[str, Any] | None) -> dict[str, Any]:
        raise NotImplementedError

    def schema(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The rule as a JSON Schema (``defaults``: the server's settings, see :class:`Is`)."""
        return {"description": self.message, **self.body(defaults)}

    def check(self, model: BaseModel) -> None:
        """Raise a pydantic error naming :attr:`param` when the model breaks the rule."""
        if not self.ok(model):
            raise PydanticCustomError("request_rule", self.message, {"param": self.param})


class AtMostOne(Rule):
    """At most one of two fields is given (not null)."""

    def __init__(self, a: str, b: str, param: str | None = None) -> None:
        super().__init__(f"give {a} or {b}, not both", param or a)
        self.a, self.b = Given(a), Given(b)

    def ok(self, model: BaseModel) -> bool:
        return not (self.a.holds(model) and self.b.holds(model))

    def body(self, defaults):
        return {"anyOf": [self.a.negated(defaults), self.b.negated(defaults)]}


class ExactlyOne(Rule):
    """Exactly one of two fields is given (not null)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"give exactly one of {a} and {b}", a)
        self.a, self.b = Given(a), Given(b)

    def ok(self, model: BaseModel) -> bool:
        return self.a.holds(model) != self.b.holds(model)

    def body(self, defaults):
        return {"oneOf": [self.a.schema(defaults), self.b.schema(defaults)]}


class Implies(Rule):
    """When ``premise`` holds, ``conclusion`` must hold."""

    def __init__(self, premise: Cond, conclusion: Cond, message: str, param: str) -> None:
        super().__init__(message, param)
        self.premise, self.conclusion = premise, conclusion

    def ok(self, model: BaseModel) -> bool:
        return not self.premise.holds(model) or self.conclusion.holds(model)

    def body(self, defaults):
        return {"anyOf": [self.premise.negated(defaults), self.conclusion.schema(defaults)]}


class RuledModel(BaseModel):
    """A request model (unknown fields refused) with cross-field ``rules``, inherited and added to by subclasses:
    checked after field validation, stated in the schema as ``allOf``."""

    model_config = ConfigDict(extra="forbid")
    rules: ClassVar[tuple[Rule, ...]] = ()

    @classmethod
    def all_rules(cls) -> list[Rule]:
        """The rules of the class and of its bases, bases first."""
        return [r for klass in reversed(cls.__mro__) for r in klass.__dict__.get("rules", ())]

    @classmethod
    def rule_schemas(cls, defaults: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """The ``allOf`` entries of the schema (``defaults``: the server's settings)."""
        return [r.schema(defaults) for r in cls.all_rules()]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        RULED[cls.__name__] = cls

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in type(self).all_rules():
            rule.check(self)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        if cls.all_rules():
            target["allOf"] = cls.rule_schemas()
        return schema


#: Longest JSON text of a refused value quoted in an error message; a longer one is described by its shape.
QUOTED_VALUE_CHARS = 60


def describe_value(value: Any) -> str:
    """A refused request value as its client wrote it: its JSON text (``0.5``, ``"x"``, ``[{"type": "function"}]``)
    when short, else its JSON shape (``a list of 3 items``, ``an object with 2 keys``, ``a string of 900
    characters``). Never Python's repr, which a client of a JSON API did not write (``{'type': 'function'}``)."""
    import json

    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        text = None
    if text is not None and len(text) <= QUOTED_VALUE_CHARS:
        return text
    if isinstance(value, list):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    if isinstance(value, dict):
        return f"an object with {len(value)} key{'' if len(value) == 1 else 's'}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return f"a {type(value).__name__}"


def only(annotation: Any, legal: str) -> Any:
    """An OpenAI field accepted only at the values ``annotation`` admits (its schema says them); any other value
    is refused as a field error whose message says ``legal`` (e.g. ``only top_p = 1 is supported``)."""

    def refuse(value: Any, handler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("unhonoured", "{value} cannot be honoured: {legal}",
                                      {"value": describe_value(value), "legal": legal}) from None

    return Annotated[annotation, WrapValidator(refuse)]


__all__ = ["RULED", "AtMostOne", "ExactlyOne", "Given", "Implies", "Is", "IsText", "Not", "NullOrHas",
           "RuledModel", "describe_value", "only"]
