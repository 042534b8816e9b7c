"""A worker rides out Redis and PostgreSQL outages instead of exiting or failing the work in hand.

* `Worker` is arq's worker with its polling made patient: while Redis is unreachable each poll (queue
  reads, cron enqueues, its health key) fails, is logged once and retried with backoff, and the jobs in
  flight go on; a worker that starts while Redis is down waits for it. arq's own loop would end the worker
  on the first failed poll.
* `until_database_answers` retries a unit of a job's bookkeeping (writing an event, finishing the job)
  through a PostgreSQL restart. Each unit is idempotent: events carry dedup keys, and a job's final
  transaction is guarded by the job still running under this worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
from arq import worker as arq_worker
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_ERRORS = (RedisError, OSError, TimeoutError)
DATABASE_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
)
"""What a restarting, unreachable or overloaded PostgreSQL raises (asyncpg reports a refused connect as an
`OSError`)."""
BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


def _backoff(attempt: int) -> float:
    return BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]


class Worker(arq_worker.Worker):
    """arq's worker, which stays up while Redis is down and goes on when it is back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._redis_failures = 0

    async def main(self) -> None:
        attempt = 0
        while True:  # arq's start-up talks to Redis before anything else: wait for it
            try:
                await self.pool.ping()
                break
            except REDIS_ERRORS as exc:
                if attempt == 0:
                    logger.warning("worker: Redis is unreachable (%s); waiting for it", exc)
                await asyncio.sleep(_backoff(attempt))
                attempt += 1
        await super().main()

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except REDIS_ERRORS as exc:
            if self._redis_failures == 0:
                logger.warning("worker: Redis is unreachable (%s); jobs in flight go on, polling again", exc)
            await asyncio.sleep(_backoff(self._redis_failures))
            self._redis_failures += 1
            return
        if self._redis_failures:
            logger.info("worker: Redis is back after %d failed polls", self._redis_failures)
            self._redis_failures = 0

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        # arq takes a job's slot before it asks Redis whether the job may start: a Redis error there would
        # keep the slot for good. Each job is started on its own, and its slot given back on such an error.
        for job_id in job_ids:
            try:
                await super().start_jobs([job_id])
            except REDIS_ERRORS:
                self.job_counter = max(0, self.job_counter - 1)
                with contextlib.suppress(ValueError):  # already given back
                    self.sem.release()
                raise

    async def close(self) -> None:
        try:
            await super().close()
        except REDIS_ERRORS as exc:  # shutting down while Redis is away: close what does not need it
            logger.warning("worker: Redis unreachable at shutdown (%s)", exc)
            if self.on_shutdown:
                await self.on_shutdown(self.ctx)


async def until_database_answers(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    within_s: float,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """`await call()`, again after each failure of the database's connection, for at most `within_s`
    seconds (then the last error is raised). `on_retry` runs before each new try."""
    deadline = time.monotonic() + within_s
    attempt = 0
    while True:
        try:
            return await call()
        except DATABASE_ERRORS as exc:
            if time.monotonic() >= deadline:
                raise
            if attempt == 0:
                logger.warning("%s: the database is unreachable (%s); retrying", what, exc)
            await asyncio.sleep(_backoff(attempt))
            attempt += 1
            if on_retry is not None:
                on_retry()
