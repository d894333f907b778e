"""A cache of one resource type kept current by list + watch, as client-go's informers do: the
kubelet's view of pods, services and nodes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from finetune_local.restclient import RestClient

logger = logging.getLogger(__name__)
ObjectKey = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
Cache = dict[ObjectKey, dict[str, Any]]


def key_of(obj: Mapping[str, Any]) -> ObjectKey:
    return (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def resource_version(obj: Mapping[str, Any]) -> int:
    return int(obj["metadata"].get("resourceVersion") or 0)


def remember(cache: Cache, obj: dict[str, Any]) -> None:
    """Store `obj` unless the cache holds a newer version of it."""
    # Our own write responses can be newer than a watch event still in flight.
    old = cache.get(key_of(obj))
    if old is None or resource_version(obj) >= resource_version(old):
        cache[key_of(obj)] = obj


async def list_and_watch(
    client: RestClient, path: str, cache: Cache, changed: Callable[[], None]
) -> None:
    """Keep `cache` equal to the objects at `path`, calling `changed` after every change;
    runs until cancelled, listing again whenever the watch ends or fails."""
    while True:
        try:
            listing = await client.get(path)
            cache.clear()
            cache.update({key_of(o): o for o in listing["items"]})
            changed()
            async for event in client.watch(path, listing["metadata"]["resourceVersion"]):
                if event["type"] == "ERROR":
                    break  # 410 Gone or similar: list again
                if event["type"] == "BOOKMARK":
                    continue
                obj = event["object"]
                if event["type"] == "DELETED":
                    cache.pop(key_of(obj), None)
                else:
                    remember(cache, obj)
                changed()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.debug("kubelet watch of %s restarts: %r", path, exc)
            await asyncio.sleep(0.5)
