"""Chaos: Redis, then PostgreSQL, restarted while a job trains and chats flow.

Both servers are this test's own (a private redis-server and an embedded PostgreSQL), never the shared
ones. The job succeeds, the worker process survives both restarts, and the usage rows the gateway wrote
are exactly the chats it answered with 200.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest
from openai.types.fine_tuning import FineTuningJob

from tests.support.data import HELLO_SFT as SFT
from tests.support.engine import EngineServer
from tests.support.jobs import metrics_steps
from tests.support.servers import PostgresServer, RedisServer, restart
from tests.support.stack import Admin, GatewayServer, Tenant, WorkerProcess, free_port, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHAT = "/v1/chat/completions"
UNFINISHED = ("validating_files", "queued", "running")


class Chats:
    """Chat completions sent one after another from a few threads until stopped; counts the statuses."""

    def __init__(self, url: str, key: str, threads: int = 2) -> None:
        self.url = url
        self.key = key
        self.statuses: Counter[int | str] = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}) as http:
            while not self._stop.is_set():
                try:
                    status: int | str = http.post(CHAT, json=body, timeout=30).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with self._lock:
                    self.statuses[status] += 1
                if status != 200:
                    time.sleep(0.2)

    def __enter__(self) -> Chats:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def _gateway_200s(url: str) -> int:
    wanted = f'tunegate_http_requests_total{{method="POST",route="{CHAT}",status="200"}}'
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(wanted):
            return int(float(line.split()[-1]))
    return 0


def _usage_rows(dsn: str, org_id: str) -> int:
    async def count() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            n: int = await conn.fetchval(
                "SELECT count(*) FROM completion_usage WHERE organization_id = $1", org_id
            )
            return n
        finally:
            await conn.close()

    return asyncio.run(count())


def _retrieve(tenant: Tenant, job_id: str) -> FineTuningJob | None:
    """The job, or None for a 503 (a pooled connection the restart broke, as the SDK's retries would
    take)."""
    try:
        return tenant.client.fine_tuning.jobs.retrieve(job_id)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
        return None


def _wait_steps(tenant: Tenant, job_id: str, past: int, deadline: float) -> int:
    """Wait until the job trained beyond step `past`; returns the step it reached."""
    while True:
        try:
            status = tenant.client.fine_tuning.jobs.retrieve(job_id).status
            step = max(metrics_steps(tenant, job_id), default=0)
        except openai.APIStatusError as exc:  # a 503 while a server restarts
            assert exc.status_code == 503, exc
            status, step = "running", past
        assert status in UNFINISHED, f"the job is {status} already"
        if step > past:
            return step
        assert time.monotonic() < deadline, f"the job stayed at step {step}"
        time.sleep(0.3)


def test_redis_then_postgres_restart_while_a_job_trains_and_chats_flow(
    engine: EngineServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    redis = RedisServer(free_port(), tmp_path)
    redis.start()
    pg = PostgresServer(tmp_path / "pg")
    pg.start()
    dsn = pg.url
    settings = make_settings(
        data_dir=tmp_path / "data",
        database_url=dsn,
        redis_url=redis.url,
        tiny_model=tiny_model_dir,
        usage_flush_interval_s=0.3,
    )
    settings.base_models["tiny-chat"].upstreams = [engine.url]
    gateway = GatewayServer(settings).start()
    worker = None
    try:
        assert settings.admin_key is not None
        tenant = Admin(gateway.url, settings.admin_key.get_secret_value()).tenant("chaos")
        worker = WorkerProcess(settings, tmp_path / "worker.log", TUNEGATE_REQUEUE_INTERVAL_S="1")
        data = "\n".join(json.dumps(r) for r in SFT).encode()
        training_file = tenant.client.files.create(file=("t.jsonl", data), purpose="fine-tune").id
        job = tenant.client.fine_tuning.jobs.create(
            model="tiny-chat",
            training_file=training_file,
            method={
                "type": "supervised",
                "supervised": {"hyperparameters": {"max_steps": 120, "batch_size": 2}},  # past restarts
            },
        )
        deadline = time.monotonic() + 480
        with Chats(gateway.url, tenant.key) as chats:
            step = _wait_steps(tenant, job.id, 0, deadline)

            restart(redis)
            step = _wait_steps(tenant, job.id, step, deadline)  # trains on through it

            restart(pg)
            _wait_steps(tenant, job.id, step, deadline)

            while (current := _retrieve(tenant, job.id)) is None or current.status in UNFINISHED:
                assert time.monotonic() < deadline, f"job still {current and current.status}"
                time.sleep(0.5)
        assert current.status == "succeeded", current.error
        assert worker.proc.poll() is None, "the worker died"

        answered = chats.statuses[200]
        assert answered > 0, chats.statuses
        assert _gateway_200s(gateway.url) == answered, chats.statuses
        flushed = time.monotonic() + 60
        while (rows := _usage_rows(dsn, tenant.org_id)) != answered and time.monotonic() < flushed:
            time.sleep(0.5)
        assert rows == answered, (rows, chats.statuses)
    finally:
        if worker is not None:
            worker.stop()
        gateway.stop()
        pg.stop()
        redis.stop()
