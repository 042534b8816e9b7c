"""Which workers are alive: every worker stamps its id into a sorted set in Redis at each heartbeat, scored
with Redis's own clock (so hosts' clocks do not matter); `/readyz` and `/metrics` count the stamps younger
than `worker_alive_after_s`. A killed worker stops stamping and drops out of the count; a worker that
stops cleanly removes its stamp at once.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis

from gateway.work.resilience import REDIS_ERRORS

logger = logging.getLogger(__name__)

FORGET_AFTER_S = 24 * 3600
"""Stamps older than this are removed (and the set expires when no worker stamps for this long)."""


def presence_key(queue_name: str) -> str:
    """The sorted set of the workers of `queue_name`."""
    return f"{queue_name}:workers"


async def _now(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return float(seconds) + float(micros) / 1e6


async def stamp(redis: Redis, queue_name: str, worker_id: str) -> None:
    """Say that `worker_id` is alive now."""
    now = await _now(redis)
    key = presence_key(queue_name)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {worker_id: now})
        pipe.zremrangebyscore(key, "-inf", now - FORGET_AFTER_S)
        pipe.expire(key, FORGET_AFTER_S)
        await pipe.execute()


async def leave(redis: Redis, queue_name: str, worker_id: str) -> None:
    """Say that `worker_id` stopped (a clean shutdown)."""
    try:
        await redis.zrem(presence_key(queue_name), worker_id)
    except REDIS_ERRORS as exc:
        logger.warning("worker %s: could not remove its presence: %s", worker_id, exc)


async def keep_stamping(redis: Redis, queue_name: str, worker_id: str, every_s: float) -> None:
    """Stamp every `every_s` seconds until cancelled, through Redis outages."""
    failing = False
    while True:
        try:
            await stamp(redis, queue_name, worker_id)
            if failing:
                logger.info("worker %s: presence stamped again", worker_id)
            failing = False
        except REDIS_ERRORS as exc:
            if not failing:
                logger.warning("worker %s: cannot stamp its presence: %s", worker_id, exc)
            failing = True
        await asyncio.sleep(every_s)


async def alive_workers(redis: Redis, queue_name: str, within_s: float) -> int:
    """How many workers of `queue_name` stamped within the last `within_s` seconds."""
    now = await _now(redis)
    count: int = await redis.zcount(presence_key(queue_name), now - within_s, "+inf")
    return count
