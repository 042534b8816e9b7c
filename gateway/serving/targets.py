"""Which model a request names: base models by name, aliases, fine-tuned models, checkpoints and versions
by id within the caller's organisation. Model and version ids are remembered for a few seconds so the hot
path makes no database query for a model seen lately; aliases are read on every request (they move)."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import asyncpg

from gateway.errors import NotFound, not_found
from gateway.serving import store
from gateway.serving.engines import Target
from gateway.serving.versions import adapter_version, is_version, path_version
from gateway.settings import Settings

logger = logging.getLogger(__name__)


class ModelCache:
    """Model lookups of the last few seconds, by (organisation, model id); no DB round trip on a hit."""

    def __init__(self, ttl_s: float = 10.0, negative_ttl_s: float = 1.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str], tuple[float, Target | None]] = {}

    def get(self, org_id: str, model_id: str) -> tuple[bool, Target | None]:
        """(hit, target): a hit may be a remembered miss (target None)."""
        hit = self._entries.get((org_id, model_id))
        if hit is None or hit[0] <= time.monotonic():
            return False, None
        return True, hit[1]

    def put(self, org_id: str, model_id: str, target: Target | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        ttl = self.ttl_s if target is not None else self.negative_ttl_s
        self._entries[(org_id, model_id)] = (time.monotonic() + ttl, target)

    def invalidate(self, model_id: str) -> None:
        """Forget `model_id` for every organisation (and its checkpoints, whose ids extend it)."""
        for key in [k for k in self._entries if k[1] == model_id or k[1].startswith(model_id + ":")]:
            self._entries.pop(key, None)


ALIAS_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A plain alias name (`prod`, `support-bot.v2`); the other form is `<model id>:latest`."""
LATEST = ":latest"
REUSED_NAME = ":tinker-"
"""Marks the served model ids of Tinker sampler checkpoints (`gateway.tinker.paths.served_model_id`): saving a
sampler again under its name gives the id new weights, so these are read from the database on every request,
never remembered, and the first request after a save is served by the new version."""


def may_be_alias(name: str) -> bool:
    """Whether `name` has an alias's shape: a plain name that is not a version id, or one ending `:latest`.
    Model ids have neither (they contain `:` and end with a job id or `ckpt-step-N`), so a request for a
    model id makes no alias query."""
    if name.endswith(LATEST):
        return True
    return ALIAS_NAME_RE.fullmatch(name) is not None and not is_version(name)


async def resolve(
    settings: Settings,
    models: ModelCache,
    pool: asyncpg.Pool,
    org_id: str,
    model_id: str,
    *,
    param: str = "model",
    aliases: bool = True,
) -> Target:
    """The target of `model_id` for organisation `org_id`: a base model, an alias (read from the database on
    every call, so that a request admitted after an alias moved is served by the new model, whatever this
    gateway remembers), a fine-tuned model or checkpoint id, or a version id of one of them; else 404
    `model_not_found` (also for others' models), whose `param` is `param` (the field that named the model).
    Model and version ids are remembered for a few seconds (their versions never change, but for Tinker
    samplers', `REUSED_NAME`). `aliases=False` skips the alias step: what an alias points at is resolved
    so, since an alias never points at another alias.

    Several gateways: each reads the alias from the shared database per request, so a move is seen by every
    gateway for every request admitted after the move's transaction committed; the model ids and version ids
    an alias points at are immutable, so their cached targets never go stale by a move."""
    if model_id in settings.base_models:
        return Target(model_id=model_id, base_model=model_id)
    if aliases and may_be_alias(model_id):
        pointed = await store.find_alias(pool, org_id, model_id)
        if pointed is not None:
            try:
                return await resolve(settings, models, pool, org_id, pointed, param=param, aliases=False)
            except NotFound:
                raise NotFound(
                    f"The alias '{model_id}' points at model '{pointed}', which does not exist.",
                    param=param,
                    code="model_not_found",
                ) from None
    cacheable = REUSED_NAME not in model_id
    hit, target = models.get(org_id, model_id) if cacheable else (False, None)
    if not hit and (model_id.startswith("ft:") or is_version(model_id)):
        if is_version(model_id):
            found = await store.find_version(pool, org_id, model_id)
        else:
            found = await store.find_adapter(pool, org_id, model_id)
        target = None
        if found is not None:
            if found.base_model in settings.base_models:
                version = found.version or await _version_of(pool, org_id, model_id, found)
                target = Target(
                    model_id=model_id,
                    base_model=found.base_model,
                    adapter_path=found.adapter_path,
                    version=version,
                )
            else:
                logger.warning(
                    "model %s names base model %s, which is not configured", model_id, found.base_model
                )
        if cacheable:
            models.put(org_id, model_id, target)
    if target is None:
        raise not_found("model", model_id, param=param, code="model_not_found")
    return target


async def _version_of(pool: asyncpg.Pool, org_id: str, model_id: str, found: store.Served) -> str:
    """The version of a row written before versions: computed from its files (in a thread) and stored; a
    path-derived stand-in, not stored, when the gateway cannot read them."""
    try:
        version = await asyncio.to_thread(adapter_version, found.adapter_path)
    except OSError as exc:
        logger.warning("adapter of %s unreadable here (%s); versioned by its path", model_id, exc)
        return path_version(found.adapter_path)
    await store.set_version(pool, org_id, model_id, found, version)
    return version
