"""Polling with a deadline, for tests of what settles in the background (stats that
filters, undos and reports bring up to date)."""

from __future__ import annotations

import asyncio


async def wait_for(pred, timeout: float = 30.0, every: float = 0.02):
    """``await pred()`` until it returns something truthy (returned), or what it returned
    last once ``timeout`` seconds have passed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        got = await pred()
        if got or loop.time() > end:
            return got
        await asyncio.sleep(every)
