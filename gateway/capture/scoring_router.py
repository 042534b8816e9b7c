"""Routes that score captured episodes on the server (`gateway.capture.scoring`)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import RequestLimitDep

router = APIRouter(prefix="/v1", tags=["episodes"], dependencies=[RequestLimitDep])
