"""`StructuredOutputsParams`: the constraint a request's output must follow, named as vLLM
names it (standard library only: `SamplingParams` carries it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a completion's text.

    Attributes:
        json: a JSON schema (a dict or its JSON text): the output is one JSON value valid
            under it.
        regex: the output matches this regular expression in full.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF style, a `root` rule) the output derives from.
        json_object: True: the output is any JSON object.
        key: (kind, canonical text) of the constraint: equal constraints share one compiled
            grammar.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    key: tuple[str, str] = field(init=False, repr=False, default=("", ""))

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: expected exactly one of {', '.join(_FIELDS)}, "
                f"got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        self.key = (kind, _canonical(kind, getattr(self, kind)))

    @classmethod
    def from_dict(cls, value: object) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object.

        Raises:
            ValueError: not an object, an unknown field, or not exactly one constraint.
        """
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs: expected an object, got {value!r:.60}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"structured_outputs: expected fields among {', '.join(_FIELDS)}, got {unknown}"
            )
        return cls(**value)


def _canonical(kind: str, value: Any) -> str:
    """The constraint as text, checked for its type. A JSON schema keeps its key order:
    the output's properties follow it."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json: expected a JSON schema object, got {value!r:.60}"
            )
        return json.dumps(value)
    if kind == "choice":
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(
                f"structured_outputs.choice: expected a non-empty list of non-empty strings, "
                f"got {value!r:.60}"
            )
        return json.dumps(list(value))
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object: expected true, got {value!r}")
        return ""
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"structured_outputs.{kind}: expected a non-empty string, got {value!r:.60}"
        )
    return value
