"""Object ids in OpenAI's style: a type prefix and a random, URL-safe body."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, length: int = 24) -> str:
    """`prefix` + `length` random letters and digits (about 6 bits each)."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length))
