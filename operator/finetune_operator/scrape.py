"""Fetching the trainers' /metrics pages: short timeouts, failures ignored (I/O only)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from finetune_operator.reconcile.progress import ScrapeTarget

DEFAULT_TIMEOUT_SECONDS = 1.0


async def _fetch(session: aiohttp.ClientSession, target: ScrapeTarget) -> str | None:
    try:
        async with session.get(target.url) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        # A worker that is starting, restarting or gone has no endpoint: expected, not an error.
        return None


async def scrape_all(
    targets: Sequence[ScrapeTarget], timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> dict[ScrapeTarget, str]:
    """The pages that answered within `timeout`, keyed by target; all fetched concurrently."""
    if not targets:
        return {}
    client_timeout = aiohttp.ClientTimeout(total=timeout, connect=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        pages = await asyncio.gather(*(_fetch(session, t) for t in targets))
    return {t: page for t, page in zip(targets, pages, strict=True) if page is not None}
