"""`tunegate docs-settings`: the settings reference (`docs/settings.md`) made from the `Settings` class.

Each field's docstring (the string literal under it in its concern's module of `gateway/settings/`) is its
documentation, and each concern's class docstring introduces its section, so the reference cannot drift from
the code; `tests/test_docs.py` checks the committed page against this output.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from gateway.settings import GROUPS, Settings

logger = logging.getLogger(__name__)

ENV_PREFIX = "TUNEGATE_"


def field_docs(cls: type = Settings) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body, or in the body of one of the classes
    of the same package it inherits (a `Settings` concern)."""
    package = cls.__module__.split(".")[0]
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] != package:
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(name: str) -> str:
    info = Settings.model_fields[name]
    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Path):
        home = Path.home()
        if value.is_relative_to(home):
            return f"`~/{value.relative_to(home)}`"
    if isinstance(value, dict):
        value = {
            k: v.model_dump(mode="json", exclude_defaults=True) if hasattr(v, "model_dump") else v
            for k, v in value.items()
        }
    text = str(value)
    return f"`{text}`" if text else '`""`'


def _type(name: str) -> str:
    annotation = Settings.model_fields[name].annotation
    text = getattr(annotation, "__name__", None) if not hasattr(annotation, "__args__") else None
    if text:
        return text
    text = str(annotation)
    for prefix in ("typing.", "pydantic.types."):
        text = text.replace(prefix, "")
    return re.sub(r"gateway\.settings\.(\w+\.)*", "", text)


def env_name(field_name: str) -> str:
    """The environment variable of a settings field."""
    return ENV_PREFIX + field_name.upper()


def settings_markdown() -> str:
    """The whole settings reference as Markdown."""
    docs = field_docs()
    lines = [
        "# Settings",
        "",
        "Every tunegate process (gateway, worker, engine, CLI) reads one settings object,",
        "`gateway.settings.Settings`. Each field comes from the environment variable shown, or its default.",
        "Structured values (dicts, lists) are JSON. Durations end in `_s` (seconds).",
        "",
        "The settings are grouped by concern, one class of `gateway/settings/` each;",
        "`Settings` inherits them all.",
        "",
        "This page is generated: `python -m tunegate docs-settings > docs/settings.md`.",
    ]
    for group in GROUPS:
        module = group.__module__.rsplit(".", 1)[-1]
        intro = " ".join((group.__doc__ or "").split())
        lines += ["", f"## {module.capitalize()} (`gateway/settings/{module}.py`)", "", intro, ""]
        lines += ["| variable | type | default | meaning |", "|---|---|---|---|"]
        for name in group.model_fields:
            doc = docs.get(name, "").replace("|", "\\|")
            kind = _type(name).replace("|", "\\|")
            default = _default(name).replace("|", "\\|")
            lines.append(f"| `{env_name(name)}` | {kind} | {default} | {doc} |")
    return "\n".join(lines) + "\n"
