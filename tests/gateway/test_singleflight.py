"""`SingleFlight`: concurrent callers share one run, a caller going away cancels nothing,
failures reach all.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.singleflight import SingleFlight


async def test_concurrent_callers_share_one_run_and_later_ones_start_another() -> None:
    flights: SingleFlight[str, int] = SingleFlight()
    runs = 0
    gate = asyncio.Event()

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return runs

    callers = [asyncio.create_task(flights.run("k", work)) for _ in range(50)]
    for _ in range(5):  # the callers, then the one run, get their turns
        await asyncio.sleep(0)
    assert "k" in flights and runs == 1
    gate.set()
    assert await asyncio.gather(*callers) == [1] * 50
    assert "k" not in flights
    assert await flights.run("k", work) == 2  # a run that ended is not reused


async def test_a_caller_that_goes_away_cancels_nothing_and_failures_reach_everyone() -> None:
    flights: SingleFlight[str, str] = SingleFlight()
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "done"

    leaving = asyncio.create_task(flights.run("a", slow))
    staying = asyncio.create_task(flights.run("a", slow))
    for _ in range(5):
        await asyncio.sleep(0)
    leaving.cancel()
    gate.set()
    assert await staying == "done"
    assert leaving.cancelled()

    async def broken() -> str:
        await asyncio.sleep(0)
        raise RuntimeError("database down")

    results = await asyncio.gather(*(flights.run("b", broken) for _ in range(3)), return_exceptions=True)
    assert [str(r) for r in results] == ["database down"] * 3
    with pytest.raises(RuntimeError):
        await flights.run("b", broken)  # the next caller tries again
