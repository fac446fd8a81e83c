"""Request bodies read as JSON whatever their Content-Type, and validated into the route's schema.

OpenAI-compatible servers take a JSON body without ``Content-Type: application/json``: curl's
``-d`` sends ``application/x-www-form-urlencoded``, and the README's curl has no header. FastAPI
would hand such a body to the schema as raw bytes (a 400 that says nothing useful), so the routes
read it here. Every refusal is an ``ApiError`` naming the field (the route answers it as 400).
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .schemas import no_op_value, unsupported_fields


MAX_BODY_DEPTH = 128  # nested objects/arrays of a body (a structured-output schema has its own 64)
# UTF-16 halves: JSON's "\ud800" escape decodes to one alone, which no UTF-8 text can carry (the
# tokenizer and the corpus' C++ failed on it with a 500 that showed their signatures).
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


async def parse_body(request: Request, schema: type[BaseModel]):
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "body: empty; expected a JSON object")
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"body: nested too deeply (at most {MAX_BODY_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int of more than 4300 digits
        kind = request.headers.get("content-type", "none")
        raise ApiError(400, f"body: not valid JSON ({str(e)[:200]}; Content-Type {kind}): send a JSON object") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(obj).__name__}")
    check_text(obj)
    for name, why in unsupported_fields(schema).items():
        if name in obj:
            if not no_op_value(name, obj[name]):
                raise ApiError(400, f"{name}: not supported by this server ({why})", name, "unsupported_parameter")
            del obj[name]  # null, false, empty or a value that asks for nothing: as if absent
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        if first.get("type") == "extra_forbidden":
            raise ApiError(400, f"{where}: unknown field (not an OpenAI field this server implements, nor one of "
                                "its extensions)", where, "unknown_parameter") from None
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {msg}", where) from None


def check_text(obj: object) -> None:
    """ApiError 400 naming the first string (key or value) with a lone surrogate, or nesting deeper
    than MAX_BODY_DEPTH. Iterative: a deep body costs no recursion."""
    stack: list[tuple[object, str, int]] = [(obj, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise ApiError(400, f"{where or 'body'}: nested more than {MAX_BODY_DEPTH} levels deep", where or None)
        if isinstance(node, str):
            if (m := _SURROGATE.search(node)) is not None:
                raise ApiError(400, f"{where or 'body'}: contains a lone surrogate (U+{ord(m.group()):04X} at "
                                    f"character {m.start()}): send valid Unicode text", where or None,
                               "invalid_unicode")
        elif isinstance(node, dict):
            for k, v in node.items():
                sub = f"{where}.{k}" if where else str(k)
                if _SURROGATE.search(k):
                    raise ApiError(400, f"{where or 'body'}: a key contains a lone surrogate: send valid Unicode "
                                        "text", where or None, "invalid_unicode")
                stack.append((v, sub, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{where}.{i}", depth + 1) for i, v in enumerate(node))
