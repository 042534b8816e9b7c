"""Which model a request names: base models by name, fine-tuned models and checkpoints by id within the
caller's organisation, remembered for a few seconds so the hot path makes no database query for a model
seen lately."""

from __future__ import annotations

import logging
import time

import asyncpg

from gateway.errors import not_found
from gateway.serving import store
from gateway.serving.engines import Target
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


async def resolve(
    settings: Settings,
    models: ModelCache,
    pool: asyncpg.Pool,
    org_id: str,
    model_id: str,
    *,
    param: str = "model",
) -> Target:
    """The target of `model_id` for organisation `org_id`, or 404 `model_not_found` (also for others'
    models), whose `param` is `param` (the field that named the model)."""
    if model_id in settings.base_models:
        return Target(model_id=model_id, base_model=model_id)
    hit, target = models.get(org_id, model_id)
    if not hit and model_id.startswith("ft:"):
        found = await store.find_adapter(pool, org_id, model_id)
        target = None
        if found is not None:
            if found.base_model in settings.base_models:
                target = Target(
                    model_id=model_id, base_model=found.base_model, adapter_path=found.adapter_path
                )
            else:
                logger.warning(
                    "model %s names base model %s, which is not configured", model_id, found.base_model
                )
        models.put(org_id, model_id, target)
    if target is None:
        raise not_found("model", model_id, param=param, code="model_not_found")
    return target
