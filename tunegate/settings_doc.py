"""`tunegate docs-settings`: the settings reference (`docs/settings.md`) made from the `Settings` class.

Each field's docstring (the string literal under it in `gateway/settings.py`) is its documentation, so the
reference cannot drift from the code; `tests/test_docs.py` checks the committed page against this output.
"""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from gateway.settings import Settings

logger = logging.getLogger(__name__)

ENV_PREFIX = "TUNEGATE_"


def field_docs(cls: type = Settings) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
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
    for prefix in ("typing.", "gateway.settings.", "pydantic.types."):
        text = (text or str(annotation)).replace(prefix, "")
    return text or ""


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
        "This page is generated: `python -m tunegate docs-settings > docs/settings.md`.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name in Settings.model_fields:
        doc = docs.get(name, "").replace("|", "\\|")
        kind = _type(name).replace("|", "\\|")
        default = _default(name).replace("|", "\\|")
        lines.append(f"| `{env_name(name)}` | {kind} | {default} | {doc} |")
    return "\n".join(lines) + "\n"
