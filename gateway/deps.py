"""Resources made once in the lifespan and injected into routes with `Annotated` aliases."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Annotated

import asyncpg
from arq.connections import ArqRedis
from fastapi import Depends, Header, Request

from gateway.blobstore import BlobStore
from gateway.capture.capturer import Capturer
from gateway.errors import AuthenticationFailed, PermissionDenied
from gateway.limits.guard import Guard
from gateway.notices import Notices
from gateway.offload import Offload
from gateway.serving.engines import Engines
from gateway.serving.targets import ModelCache
from gateway.settings import Settings
from gateway.tenancy.keys import Authenticator, Principal, bearer_token
from gateway.usage.buffer import UsageBuffer


@dataclass(frozen=True, slots=True)
class Resources:
    """Everything a request may need, made in the lifespan (`gateway.app`) and shared by all requests."""

    settings: Settings
    pool: asyncpg.Pool
    blobs: BlobStore
    auth: Authenticator
    queue: ArqRedis | None
    """The job queue; None when no Redis is configured (jobs are then queued by the worker's cron)."""
    admin_key: str | None
    engines: Engines
    """The inference engines of every base model and the adapters they hold (`gateway.serving.engines`)."""
    models: ModelCache
    """Model ids resolved in the last few seconds (`gateway.serving.targets`)."""
    usage: UsageBuffer
    """Completion metering, written in batches by a background task."""
    guard: Guard
    """Rate limits and budgets (enforcing nothing where no Redis is configured)."""
    offload: Offload
    """Sandbox slots and the CPU pool, with each organisation's share (`gateway.offload`)."""
    started_at: int
    """When this gateway started (unix seconds): the `created` of base models."""
    notices: Notices
    """Wake-ups from PostgreSQL (`gateway.notices`): answered Tinker requests."""
    capture: Capturer
    """Who captures chat completions, and the batched writes of what is captured (`gateway.capture`)."""


async def get_resources(request: Request) -> Resources:
    res: Resources = request.app.state.resources
    return res


ResourcesDep = Annotated[Resources, Depends(get_resources)]


async def get_pool(res: ResourcesDep) -> asyncpg.Pool:
    return res.pool


PoolDep = Annotated[asyncpg.Pool, Depends(get_pool)]


async def authenticate_person(res: Resources, token: str) -> Principal:
    """The organisation of a live API key of a person. Every route but the inference routes authenticates
    with it (through `PrincipalDep`, `CallerDep`, `AdminOrPrincipalDep`, or directly, as the Tinker routes
    and the dashboard's sign-in do): a key minted for an eval run or a job may call the inference routes
    only (`gateway.tenancy.scoped`), so it is 403 here."""
    who = await res.auth.authenticate(token)
    if who.kind != "user":
        raise PermissionDenied(
            f"This key was minted for the gateway's own work (kind '{who.kind}') and may call only the "
            "inference routes (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages)."
        )
    return who


async def get_principal(
    res: ResourcesDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    """The calling organisation, from a live API key of a person."""
    return await authenticate_person(res, bearer_token(authorization))


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def limit_requests(res: ResourcesDep, who: PrincipalDep) -> None:
    """One request off the calling key's per-minute request limit, the bucket its completions take from too:
    429 `rate_limit_exceeded` over it. A router dependency of the files, evals, graders,
    jobs and models routes (the usage routes, which the admin key may call too, take it themselves)."""
    await res.guard.admit_request(who.organization_id, who.api_key_id)


RequestLimitDep = Depends(limit_requests)


@dataclass(frozen=True, slots=True)
class Caller:
    """The calling organisation and the key it called with: a request that makes model calls of its own
    (`graders/run`, `environments/run`) makes them with this key (`gateway.serving.calls`)."""

    principal: Principal
    key: str = field(repr=False)


async def get_caller(res: ResourcesDep, authorization: Annotated[str | None, Header()] = None) -> Caller:
    token = bearer_token(authorization)
    return Caller(await authenticate_person(res, token), token)


CallerDep = Annotated[Caller, Depends(get_caller)]


def is_admin_key(res: Resources, token: str) -> bool:
    """Whether `token` is the admin key (compared in constant time)."""
    if not res.admin_key:
        return False
    return hmac.compare_digest(token.encode(), res.admin_key.encode())


async def require_admin(res: ResourcesDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Admin routes: the bearer token must be the admin key."""
    if not is_admin_key(res, bearer_token(authorization)):
        raise AuthenticationFailed("Incorrect admin key provided.")


AdminDep = Depends(require_admin)


async def get_admin_or_principal(
    res: ResourcesDep, authorization: Annotated[str | None, Header()] = None
) -> Principal | None:
    """Routes that both the admin key and an organisation's keys call (the usage routes): None for the admin
    key, else the calling organisation, as `PrincipalDep` finds it."""
    token = bearer_token(authorization)
    if is_admin_key(res, token):
        return None
    return await authenticate_person(res, token)


AdminOrPrincipalDep = Annotated[Principal | None, Depends(get_admin_or_principal)]
