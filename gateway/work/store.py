"""The SQL of workers as such: the workers table (each worker's devices, for refusing a job larger than every
live worker) and the fair order in which a worker takes the work that needs its devices.

`FAIREST` ranks the two kinds of work a worker runs on its devices, queued fine-tuning jobs and Tinker
training models waiting for a holder, across organisations. The statements that hold, hand back and take
back each kind are its area's (`gateway.work.lease`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.db import Conn, maybe_row_to

# The fairest work that fits the free devices, of both kinds a worker runs on its devices: queued jobs and
# Tinker training models waiting for a holder (open requests, no worker). The organisation with the fewest
# running jobs and held models first, then the one that started either least recently, then the work that
# has waited longest. $3, when not null, is a held model whose holder asks whether to let its slot go
# (`gateway.tinker.holder`): it is ranked as if it waited, had just been taken (as `HAND_BACK_MODEL` records
# it), and had waited least of all.
FAIREST = """
WITH work AS (
    SELECT 'job' AS kind, j.id, j.organization_id, j.queued_at AS since, j.seq
    FROM fine_tuning_jobs j
    WHERE j.status = 'queued' AND j.worker_id IS NULL
      -- only a job whose devices (and a reinforcement job's generation devices) are free here
      AND j.gpus + CASE WHEN j.method_type = 'reinforcement' THEN $2::int ELSE 0 END <= $1
    UNION ALL
    SELECT 'tinker', m.id, m.organization_id, w.since, m.seq
    FROM (SELECT model_id, min(created_at) AS since FROM tinker_requests
          WHERE status IN ('pending', 'running') AND model_id IS NOT NULL GROUP BY model_id) w
    JOIN tinker_models m ON m.id = w.model_id
    WHERE m.worker_id IS NULL AND m.lost IS NULL AND $1 >= 1
    UNION ALL
    SELECT 'tinker', m.id, m.organization_id, now(), m.seq FROM tinker_models m WHERE m.id = $3::text
)
SELECT w.kind, w.id FROM work w
ORDER BY (SELECT count(*) FROM fine_tuning_jobs r
          WHERE r.organization_id = w.organization_id AND r.status = 'running')
         + (SELECT count(*) FROM tinker_models t
            WHERE t.organization_id = w.organization_id AND t.worker_id IS NOT NULL
              AND t.id IS DISTINCT FROM $3::text),
         greatest((SELECT max(r.started_at) FROM fine_tuning_jobs r
                   WHERE r.organization_id = w.organization_id),
                  (SELECT max(t.held_at) FROM tinker_models t
                   WHERE t.organization_id = w.organization_id),
                  (SELECT now() FROM tinker_models t
                   WHERE t.id = $3::text AND t.organization_id = w.organization_id))
             NULLS FIRST,
         w.since, w.seq
LIMIT 1"""


@dataclass(frozen=True, slots=True)
class Work:
    """What a worker may take next: a queued job or a Tinker model waiting for a holder."""

    kind: Literal["job", "tinker"]
    id: str


async def fairest(conn: Conn, *, free: int, generation: int = 0, holding: str | None = None) -> Work | None:
    """The fairest work that fits `free` devices (a reinforcement job takes `generation` more, a Tinker
    model one device), across organisations as `FAIREST` orders it; None when nothing waits. `holding`: a
    held model that would give its device back (counted in `free`), ranked among the waiting work as if it
    had just been taken; it is the answer when nothing else should have its device first."""
    return maybe_row_to(Work, await conn.fetchrow(FAIREST, free, generation, holding))


ANNOUNCE = """
INSERT INTO workers (id, devices, device_kind) VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE
SET devices = EXCLUDED.devices, device_kind = EXCLUDED.device_kind, seen_at = now()"""
LEAVE = "DELETE FROM workers WHERE id = $1"
LARGEST = "SELECT max(devices) FROM workers WHERE seen_at > now() - make_interval(secs => $1)"


async def announce(conn: Conn, *, worker_id: str, devices: int, kind: str) -> None:
    """This worker is alive and owns `devices` devices of `kind`."""
    await conn.execute(ANNOUNCE, worker_id, devices, kind)


async def leave(conn: Conn, *, worker_id: str) -> None:
    await conn.execute(LEAVE, worker_id)


async def largest_worker(conn: Conn, *, within_s: float) -> int | None:
    """The most devices a worker seen in the last `within_s` seconds owns (None: no worker seen)."""
    value = await conn.fetchval(LARGEST, within_s)
    return int(value) if value is not None else None
