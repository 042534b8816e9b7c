"""Helpers for tests of capture: turning it on for an organisation, and waiting for what the gateway writes
in batches off the request path (captured calls, episodes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from tests.support.stack import Admin, Tenant

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], what: str, within_s: float = 30) -> T:
    """`probe()` once it answers something (captures are written about every second)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def capture_on(admin: Admin, t: Tenant, **body: Any) -> dict[str, Any]:
    """Capture on for the organisation of `t` (`body`: more of the setting, such as `retention_days`); the
    setting as the admin API answers it."""
    resp = admin.http.post(f"/v1/admin/organizations/{t.org_id}/capture", json={"enabled": True, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())
