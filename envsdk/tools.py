"""``@tool``: typed Python functions -> OpenAI tool schemas.

The schema comes from the signature (type hints) and a Google-style docstring: the summary becomes the
tool's ``description`` and each ``Args:`` entry the description of that parameter::

    @tool
    def add(a: float, b: float) -> float:
        '''Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        '''
        return a + b

    add.__envsdk_tool__  # {"type": "function", "function": {"name": "add", ...}}
"""

from __future__ import annotations

import inspect
import logging
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

logger = logging.getLogger(__name__)

TOOL_ATTR = "__envsdk_tool__"
F = TypeVar("F", bound=Callable[..., Any])

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def json_schema_for(annotation: Any) -> dict[str, Any]:
    """JSON schema of a Python type annotation (str/int/float/bool, list, dict, Literal, Optional)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if annotation is type(None):
        return {"type": "null"}
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        values = list(args)
        schema: dict[str, Any] = {"enum": values}
        kinds = {type(v) for v in values}
        if len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
            schema["type"] = _SCALARS[next(iter(kinds))]
        return schema
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return json_schema_for(members[0])
        return {"anyOf": [json_schema_for(a) for a in members]}
    if annotation is list or origin is list or annotation is tuple or origin is tuple:
        schema = {"type": "array"}
        if args and origin is list:
            schema["items"] = json_schema_for(args[0])
        return schema
    if annotation is dict or origin is dict:
        return {"type": "object"}
    raise TypeError(f"unsupported type for a tool parameter: {annotation!r}")


def parse_google_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {parameter: description})."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in lines:
        header = re.fullmatch(r"(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*", line)
        if header:
            section = header.group(1)
            current = None
            continue
        if section is None:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters"):
            entry = re.match(r"\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if entry and (len(line) - len(line.lstrip())) <= 4:
                current = entry.group(1).lstrip("*")
                params[current] = entry.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    description = "\n".join(summary).strip()
    return description, params


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """OpenAI tool schema of ``fn`` (``self``/``cls`` skipped)."""
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to raw annotations
        hints = {}
    description, param_docs = parse_google_docstring(fn.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in signature.parameters.items():
        if pname in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema = json_schema_for(hints.get(pname, param.annotation))
        if pname in param_docs:
            schema["description"] = param_docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            schema["default"] = param.default
        properties[pname] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name or fn.__name__, "description": description, "parameters": parameters},
    }


def tool(fn: F | None = None, *, name: str | None = None) -> Any:
    """Mark a function or method as a tool the model may call; usable as ``@tool`` or ``@tool(name=...)``."""

    def mark(f: F) -> F:
        setattr(f, TOOL_ATTR, tool_schema(f, name))
        return f

    if fn is None:
        return mark
    return mark(fn)


def is_tool(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, TOOL_ATTR)


def get_schema(obj: Any) -> dict[str, Any]:
    schema: dict[str, Any] = getattr(obj, TOOL_ATTR)
    return schema
