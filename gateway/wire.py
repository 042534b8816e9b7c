"""What the gateway takes from clients as JSON and as text, checked in one place.

Every routed request (its path and query parameters and its JSON body, through `check_request`, a dependency
of the whole app), every line of a JSONL upload (`loads`) and the multipart fields of an upload
(`check_text`) are held to the same rules, so that nothing a client sends can fail later in PostgreSQL, in
orjson, in the sandbox's channel or in an engine:

* strict JSON: no `NaN` or `Infinity`, and numbers finite as doubles (`1e400` is not);
* no NUL characters (PostgreSQL stores none in `text` or `jsonb`) and no unpaired UTF-16 surrogates (not
  encodable as UTF-8) in strings or keys;
* integers within signed 64 bits (PostgreSQL's `bigint`, orjson's and the engines' integers);
* at most `max_json_depth` levels of nested arrays and objects.

A violation is a 400 `invalid_value` whose `param` names the field (`metadata.team`, `messages[2].content`).
The proxied completions keep their own single parse (`serving.protocol`): they call `diagnose` only when
orjson refuses a body, so naming the field costs the hot path nothing.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from gateway.errors import InvalidRequest

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
DEFAULT_MAX_DEPTH = 64
"""Nesting cap where no settings are at hand (`Settings.max_json_depth` is the same by default)."""


class _Literal:
    """A JSON token Python's parser takes but the gateway does not (`NaN`, `Infinity`, a huge integer),
    kept as a marker so that the walk can name the field that holds it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _int(text: str) -> int | _Literal:
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else _Literal(text)


def _field(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _text_problem(value: str) -> str | None:
    if "\x00" in value:
        return "must not contain NUL characters (\\u0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain unpaired surrogates (such as \\ud800)"
    return None


def _invalid(param: str, problem: str) -> InvalidRequest:
    name = param or "body"
    return InvalidRequest(f"Invalid value for '{name}': {problem}.", param=name, code="invalid_value")


def check_text(value: str, param: str) -> None:
    """A 400 naming `param` when `value` holds a NUL character or an unpaired surrogate."""
    problem = _text_problem(value)
    if problem is not None:
        raise _invalid(param, problem)


def check(value: Any, *, max_depth: int = DEFAULT_MAX_DEPTH, root: str = "") -> None:
    """Hold a parsed JSON value to the rules above; a 400 naming the first field that breaks one.

    Iterative (no recursion however deep the value), one pass over the value.
    """
    stack: list[tuple[Any, str, int]] = [(value, root, 0)]
    while stack:
        item, path, depth = stack.pop()
        kind = type(item)
        if kind is str:
            problem = _text_problem(item)
            if problem is not None:
                raise _invalid(path, f"strings {problem}")
        elif kind is int:
            if not INT64_MIN <= item <= INT64_MAX:
                raise _invalid(path, "integers must lie within signed 64 bits")
        elif kind is float:
            if not math.isfinite(item):
                raise _invalid(path, "numbers must be finite (NaN and Infinity are not JSON)")
        elif kind is dict or kind is list:
            if depth >= max_depth:
                raise _invalid(path, f"JSON may nest at most {max_depth} levels of arrays and objects")
            if kind is dict:
                for key, sub in item.items():
                    if type(key) is str:
                        problem = _text_problem(key)
                        if problem is not None:
                            raise _invalid(path, f"keys {problem}")
                    stack.append((sub, _field(path, key), depth + 1))
            else:
                stack.extend((sub, _field(path, i), depth + 1) for i, sub in enumerate(item))
        elif kind is _Literal:
            text = item.text
            if text in ("NaN", "Infinity", "-Infinity"):
                raise _invalid(path, f"{text} is not a JSON number")
            raise _invalid(path, "integers must lie within signed 64 bits")


def _python_loads(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_Literal, parse_int=_int)


def loads(text: str | bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, root: str = "") -> Any:
    """Parse and check one JSON document; `ValueError` when it is not JSON at all."""
    try:
        value = _python_loads(text)
    except RecursionError:
        raise _invalid(root, f"JSON may nest at most {max_depth} levels of arrays and objects") from None
    check(value, max_depth=max_depth, root=root)
    return value


def diagnose(raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH) -> InvalidRequest | None:
    """For a body a strict parser refused: the 400 naming the field at fault, when Python's lenient parser
    reads the body and finds one (NaN, Infinity, a huge number, an unpaired surrogate, deep nesting); None
    when the body is simply not JSON."""
    try:
        loads(raw, max_depth=max_depth)
    except InvalidRequest as exc:
        return exc
    except ValueError:
        return None
    return None


def _json_media(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (no type at all counts)."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media.startswith("application/") and (media.endswith("/json") or media.endswith("+json"))


async def check_request(request: Request) -> None:
    """App-wide dependency: path and query parameters, and the JSON body FastAPI parsed, by the rules above.

    Runs before the route's own dependencies and its body model, so a bad value is refused before anything
    reaches the database, with the field named.
    """
    for name, value in request.path_params.items():
        if isinstance(value, str):
            check_text(value, name)
    for name, value in request.query_params.multi_items():
        check_text(name, name.encode("ascii", "backslashreplace").decode())
        check_text(value, name)
    route = request.scope.get("route")
    if getattr(route, "body_field", None) is None or not _json_media(request.headers.get("content-type")):
        return
    if not await request.body():
        return
    settings = getattr(getattr(request.app.state, "resources", None), "settings", None)
    depth = settings.max_json_depth if settings is not None else DEFAULT_MAX_DEPTH
    check(await request.json(), max_depth=depth)
