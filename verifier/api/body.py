"""Request bodies read as JSON whatever their Content-Type, and validated into the route's schema.

OpenAI-compatible servers take a JSON body without ``Content-Type: application/json``: curl's
``-d`` sends ``application/x-www-form-urlencoded``, and the README's curl has no header. FastAPI
would hand such a body to the schema as raw bytes (a 400 that says nothing useful), so the routes
read it here. Every refusal is an ``ApiError`` naming the field (the route answers it as 400).
"""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .schemas import no_op_value, unsupported_fields


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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        kind = request.headers.get("content-type", "none")
        raise ApiError(400, f"body: not valid JSON ({e}; Content-Type {kind}): send a JSON object") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(obj).__name__}")
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
