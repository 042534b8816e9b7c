"""Dashboard sign-in: an API key (or the admin key) checked once, then an opaque cookie.

The cookie holds a random session id and a one-time pad as long as the key; the database row, found by the
id's SHA-256, holds the key XOR the pad (`sealed`), the key's id and a CSRF token. So neither the cookie
alone nor the database alone reveals the key, and the dashboard's calls to the API are made with the key
itself: the API scopes them exactly as it scopes the SDK's. A session ends when it expires, when it signs
out, or at its next request once its key is revoked (the lookup joins the key's row).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from gateway.dashboard import store
from gateway.deps import Resources, authenticate_person
from gateway.errors import AuthenticationFailed, InvalidRequest, PermissionDenied

COOKIE = "tunegate_dashboard"
CSRF_HEADER = "x-csrf-token"
TTL_S = 12 * 3600.0
"""A session lives twelve hours at most."""
MAX_KEY_CHARS = 512
NO_SESSION = "no_dashboard_session"
"""The error code that sends the browser back to the sign-in page (any other 401 is shown as it is)."""


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in browser: an organisation's key, or the admin key (`organization_id` None)."""

    organization_id: str | None
    api_key_id: str | None
    is_admin: bool
    csrf_token: str
    key: str = field(repr=False)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


async def sign_in(res: Resources, key: str) -> tuple[str, Session]:
    """Check `key` as the API would and open a session; returns `(cookie value, session)`."""
    key = key.strip()
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidRequest("Enter an API key.", param="key")
    if res.admin_key and hmac.compare_digest(key.encode(), res.admin_key.encode()):
        org_id, key_id, is_admin = None, None, True
    else:
        who = await authenticate_person(res, key)  # 401 for an unknown or revoked key, 403 for a minted one
        org_id, key_id, is_admin = who.organization_id, who.api_key_id, False
    sid, raw = secrets.token_bytes(32), key.encode()
    pad = secrets.token_bytes(len(raw))
    csrf = secrets.token_urlsafe(32)
    await store.delete_expired(res.pool)
    await store.insert_session(
        res.pool,
        id_digest=hashlib.sha256(sid).digest(),
        org_id=org_id,
        api_key_id=key_id,
        is_admin=is_admin,
        sealed=_xor(raw, pad),
        csrf_token=csrf,
        ttl_s=TTL_S,
    )
    return f"{_b64(sid)}.{_b64(pad)}", Session(org_id, key_id, is_admin, csrf, key)


def _split(cookie: str | None) -> tuple[bytes, bytes] | None:
    if not cookie or cookie.count(".") != 1 or len(cookie) > 2 * MAX_KEY_CHARS:
        return None
    sid_text, pad_text = cookie.split(".")
    try:
        return _unb64(sid_text), _unb64(pad_text)
    except (binascii.Error, ValueError):
        return None


async def lookup(res: Resources, cookie: str | None) -> Session | None:
    """The live session of a cookie, or None (no cookie, unknown, expired, signed out, key revoked)."""
    parts = _split(cookie)
    if parts is None:
        return None
    sid, pad = parts
    row = await store.get_session(res.pool, id_digest=hashlib.sha256(sid).digest())
    if row is None or len(row.sealed) != len(pad):
        return None
    try:
        key = _xor(row.sealed, pad).decode()
    except UnicodeDecodeError:
        return None
    return Session(row.organization_id, row.api_key_id, row.is_admin, row.csrf_token, key)


async def require(res: Resources, cookie: str | None) -> Session:
    """`lookup`, or the 401 that sends the browser back to the sign-in page."""
    session = await lookup(res, cookie)
    if session is None:
        raise AuthenticationFailed(
            "You are not signed in to the dashboard (or your session ended).", code=NO_SESSION
        )
    return session


def check_csrf(session: Session, token: str | None) -> None:
    """Every request that changes something carries the session's CSRF token in a header."""
    if not token or not hmac.compare_digest(token.encode(), session.csrf_token.encode()):
        raise PermissionDenied(
            "The request did not carry this session's CSRF token; reload the page.", code="invalid_csrf_token"
        )


async def sign_out(res: Resources, cookie: str | None) -> None:
    parts = _split(cookie)
    if parts is not None:
        await store.delete_session(res.pool, id_digest=hashlib.sha256(parts[0]).digest())
