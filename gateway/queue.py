"""The job queue on Redis (arq). Postgres is the truth; a queue message only wakes a worker.

A job is enqueued under the arq job id `<job id>:<queue generation>`, so one queued period of a job is one
message (arq drops duplicates) and a resumed job gets a fresh one. If Redis is down, nothing is lost: the job
stays `queued` in Postgres and the worker's periodic task enqueues it later. Eval runs travel the same way,
as `run_eval` messages.
"""

from __future__ import annotations

import asyncio
import logging

from arq.connections import ArqRedis
from redis.asyncio import ConnectionPool
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

RUN_JOB = "run_job"
RUN_EVAL = "run_eval"
ENQUEUE_TIMEOUT_S = 2.0


def make_queue(redis_url: str) -> ArqRedis:
    """An arq client that connects lazily (a gateway starts even while Redis is down)."""
    pool = ConnectionPool.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=5.0)
    return ArqRedis(connection_pool=pool)


def queue_job_id(job_id: str, generation: int) -> str:
    return f"{job_id}:{generation}"


async def enqueue(
    queue: ArqRedis | None, queue_name: str, job_id: str, generation: int, *, function: str = RUN_JOB
) -> bool:
    """Wake a worker for a queued job (or, with `function=RUN_EVAL`, a queued eval run). Returns False (and
    logs) when Redis cannot be reached."""
    if queue is None:
        return False
    try:
        await asyncio.wait_for(
            queue.enqueue_job(
                function, job_id, _job_id=queue_job_id(job_id, generation), _queue_name=queue_name
            ),
            ENQUEUE_TIMEOUT_S,
        )
        return True
    except (RedisError, OSError, TimeoutError) as exc:
        logger.warning("could not enqueue %s (will retry from the worker): %s", job_id, exc)
        return False
