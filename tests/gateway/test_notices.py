"""Wake-ups through PostgreSQL's LISTEN/NOTIFY (`gateway.notices`): a waiter registered before a notice is
woken by it, only by its own key, and a dropped listening connection is opened again (waits meanwhile end at
their timeout, as a poll would)."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.notices import RECONNECT_S, Notices


async def test_a_notice_wakes_the_waiters_of_its_key(migrated_pool: asyncpg.Pool, own_database: str) -> None:
    notices = Notices(own_database, ("tinker_answer",))
    try:
        with (
            notices.watching("tinker_answer", "tr-1") as mine,
            notices.watching("tinker_answer", "tr-2") as other,
        ):
            await notices.wait(mine, 0.01)  # listening now
            await migrated_pool.execute("SELECT pg_notify('tinker_answer', 'tr-1')")
            assert await notices.wait(mine, 5.0)
            assert not await notices.wait(other, 0.2)  # another key's notice wakes nobody else
        assert notices._waiters == {}  # left with the with-block, answered or not

        # a notice sent before the wait but after `watching` is not missed
        with notices.watching("tinker_answer", "tr-3") as early:
            await migrated_pool.execute("SELECT pg_notify('tinker_answer', 'tr-3')")
            await asyncio.sleep(0.2)
            assert early.done() and await notices.wait(early, 0.01)

        # the listening connection dies: waits time out, then listening starts again
        killed = await migrated_pool.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE query LIKE 'LISTEN%' AND datname = current_database()"
        )
        assert killed == 1
        await asyncio.sleep(RECONNECT_S + 0.2)
        with notices.watching("tinker_answer", "tr-4") as later:
            await notices.wait(later, 0.01)  # opens a new listening connection
            await migrated_pool.execute("SELECT pg_notify('tinker_answer', 'tr-4')")
            assert await notices.wait(later, 5.0)
    finally:
        await notices.aclose()
