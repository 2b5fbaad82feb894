"""Reconcile slots: at most n at once; a waiting urgent reconcile (a decision to carry out)
gets the next free slot before the bulk ones queued ahead of it, and a bulk waiter promoted
while it waits moves up."""

from __future__ import annotations

import asyncio

from kvfleet.operator.slots import Slots


def test_urgent_work_overtakes_a_queued_burst_and_promotion_moves_a_waiter_up() -> None:
    order: list[str] = []

    async def scenario() -> None:
        slots = Slots(1)
        gate = asyncio.Event()

        async def job(name: str, urgent: bool = False) -> None:
            lane = await slots.acquire(urgent, name)
            order.append(name + ("!" if lane else ""))
            if name == "first":
                await gate.wait()
            slots.release()

        first = asyncio.create_task(job("first"))
        await asyncio.sleep(0)
        burst = [asyncio.create_task(job(f"bulk-{i}")) for i in range(3)]
        await asyncio.sleep(0)
        urgent = asyncio.create_task(job("scale", urgent=True))
        await asyncio.sleep(0)
        slots.promote("bulk-2")  # its pool got a decision while it waited
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *burst, urgent)
        assert slots.waiting(True) == slots.waiting(False) == 0

    asyncio.run(scenario())
    assert order == ["first", "scale!", "bulk-2!", "bulk-0", "bulk-1"]


def test_a_cancelled_waiter_passes_its_slot_on() -> None:
    async def scenario() -> bool:
        slots = Slots(1)
        await slots.acquire()
        waiter = asyncio.create_task(slots.acquire())
        other = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        slots.release()
        await asyncio.wait_for(other, 1)
        return other.done()

    assert asyncio.run(scenario())
