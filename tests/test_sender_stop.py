"""Stopping the server as a sender is woken: the notifier's and the forge sender's loops, cancelled (the server
stopping) just as a commit or a finished send wakes them, end. On Python 3.11, asyncio.wait_for returned the wake
and swallowed the cancel, so the loop went on and the app's shutdown waited for it for ever (a full suite run hung
in a test client's teardown).

Each case parks the sender (its first round over, waiting to be woken), then wakes it and cancels it in one step of
the event loop, a step later, and so on, so the cancel lands at each point of the wake's way through the loop. The
sender runs under `leader_only`, as the app runs it. The race is the event loop's, whatever the engine, so the sender
works on a SQLite file: its single writer answers in order, so the test's empty write comes back after the
notifier's round (the forge sender's round is a read on a thread; the later steps cover it)."""

from __future__ import annotations

import asyncio

import pytest

from switchboard.app import leader_only
from switchboard.crypto import SecretBox, sealed_sample
from switchboard.database import Database
from switchboard.forge import ForgeSender
from switchboard.notifier import Addresses, Notifier

STEPS = 16  # loop steps from parked to cancelled: the wake's way through the loop takes fewer
STOP_SECONDS = 5.0  # a sender stops at once; one that swallowed the cancel waits up to 60 s to be woken


def nothing(txn) -> None:
    return None


async def stopped_in_time(db: Database, sender, steps: int) -> bool:
    """Whether the sender, parked, then woken and cancelled `steps` loop steps later, ends within STOP_SECONDS."""
    runner = asyncio.create_task(leader_only(db, sender.run))
    await db.write(nothing)  # queued after the sender's first round, so answered after it
    for _ in range(steps):
        await asyncio.sleep(0)
    sender.wake()
    runner.cancel()
    done, _ = await asyncio.wait({runner}, timeout=STOP_SECONDS)
    if not done:  # the cancel was swallowed: cancel again, so the case ends
        runner.cancel()
        await asyncio.wait({runner}, timeout=STOP_SECONDS)
    return bool(done)


@pytest.mark.parametrize("kind", ["notifier", "forge sender"])
def test_a_sender_cancelled_as_it_is_woken_stops(tmp_path, kind):
    path = str(tmp_path / "switchboard.db")
    db = Database(path)
    box = SecretBox.for_database(path, db.read_sync(sealed_sample))
    sender = (Notifier(db, box, None, addresses=Addresses.configured(False, "")) if kind == "notifier"
              else ForgeSender(db, box, Addresses.configured(False, "")))

    async def every_step() -> dict[int, bool]:
        db.loop = asyncio.get_running_loop()
        stopped = {steps: await stopped_in_time(db, sender, steps) for steps in range(STEPS)}
        await sender.close()
        return stopped

    try:
        stopped = asyncio.run(every_step())
    finally:
        db.close()
    assert all(stopped.values()), (f"the {kind} went on after its cancel, when woken and cancelled this many loop"
                                   f" steps after it parked: {[steps for steps, ok in stopped.items() if not ok]}")
