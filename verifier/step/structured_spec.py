"""What a structured-output request asks for: a JSON schema, any JSON object, a regex, or an EBNF
grammar. Plain data with no engine behind it (``verifier/step/grammar.py`` compiles it), so sampling
parameters can carry it and the API can build it from OpenAI's ``response_format`` and from the
``regex`` / ``ebnf`` extensions (SGLang's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .spec_limits import check_grammar, check_regex, check_schema

KINDS = ("json_schema", "json_object", "regex", "ebnf")
MAX_SOURCE_CHARS = 1 << 18  # a schema or grammar larger than this is refused before compiling


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str = ""  # the schema as JSON text, the regex, or the grammar (GBNF: `root ::= ...`)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind: expected one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"{self.kind}: expected a string, got {type(self.source).__name__}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ValueError(f"{self.kind}: {len(self.source)} characters, at most {MAX_SOURCE_CHARS} allowed")
        if self.kind in ("regex", "ebnf") and not self.source:
            raise ValueError(f"{self.kind}: expected a non-empty string")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema: not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("json_schema: nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema: expected a JSON object, got {type(schema).__name__}")
            check_schema(schema)  # depth, $ref recursion, patterns (spec_limits.py)
        if self.kind == "regex":
            check_regex(self.source)
        if self.kind == "ebnf":
            check_grammar(self.source)

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "GrammarSpec":
        try:
            return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
        except RecursionError:
            raise ValueError("json_schema: nested too deeply") from None


def from_openai(response_format: dict | None, regex: str | None, ebnf: str | None) -> GrammarSpec | None:
    """OpenAI's ``response_format`` ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}) or one of the ``regex`` / ``ebnf`` extensions; at most one."""
    given = [n for n, v in (("response_format", response_format), ("regex", regex), ("ebnf", ebnf)) if v is not None]
    if response_format is not None and response_format.get("type") == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give at most one structured-output constraint")
    if regex is not None:
        return GrammarSpec("regex", regex)
    if ebnf is not None:
        return GrammarSpec("ebnf", ebnf)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format.json_schema: expected {\"name\": ..., \"schema\": {...}}")
        if not isinstance(spec["schema"], (dict, bool)):
            raise ValueError(f"response_format.json_schema.schema: expected a JSON object, got {type(spec['schema']).__name__}")
        return GrammarSpec.json_schema(spec["schema"])
    raise ValueError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")
