"""What the debugger's tests share: the fixture records, and running a Textual
Pilot test with plain asyncio (no pytest plugin needed)."""

from __future__ import annotations

import asyncio
import functools
import os

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MLP = os.path.join(FIXTURES, "mlp.record.json")
NAN = os.path.join(FIXTURES, "mlp_nan.record.json")


def pilot_test(fn):
    """Run an async Pilot test with asyncio."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))
    return run


async def opened(pilot) -> None:
    """Wait until the loading worker is done and the screen shows the record."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
