"""Object storage with a global resourceVersion and a replayable event log.

Objects live in kmock's :class:`kmock.ObjectsArray` (so each keeps its recent history, handy in
tests), keyed by ``(resource, namespace, name)``. Every write takes the next value of one
cluster-wide counter as its ``resourceVersion`` and appends a watch event to a bounded log, so a
watch that starts from a list's resourceVersion replays exactly the changes it missed; a watch
from a version older than the log answers ``410 Gone``, as etcd compaction makes a real server do.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import kmock
from kmock import KubernetesError

from finetune_local.apiresources import ResourceType

_LOG_SIZE = 20_000  # events kept for watch replay
_HISTORY_SIZE = 8  # versions kept per object (kmock keeps all; long runs patch a lot)


class ApiError(KubernetesError):
    """An error answered with a Kubernetes ``Status`` body."""


def _resource(rtype: ResourceType) -> str:
    return f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural


def _object_error(code: int, reason: str, message: str, rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        code, reason, message, {"name": name, "group": rtype.group, "kind": rtype.plural}
    )


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return _object_error(404, "NotFound", f'{_resource(rtype)} "{name}" not found', rtype, name)


def already_exists(rtype: ResourceType, name: str) -> ApiError:
    message = f'{_resource(rtype)} "{name}" already exists'
    return _object_error(409, "AlreadyExists", message, rtype, name)


def conflict(rtype: ResourceType, name: str, why: str) -> ApiError:
    message = f'Operation cannot be fulfilled on {_resource(rtype)} "{name}": {why}'
    return _object_error(409, "Conflict", message, rtype, name)


def invalid(rtype: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    qualified = f"{rtype.kind}.{rtype.group}" if rtype.group else rtype.kind
    texts = [f"{field}: {message}" if field else message for field, message in causes]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{qualified} "{name}" is invalid: {joined}',
        {
            "name": name,
            "group": rtype.group,
            "kind": rtype.kind,
            "causes": [
                {"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes
            ],
        },
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message, {})


@dataclass(frozen=True)
class WatchEvent:
    resource_version: int
    key: tuple[str, str, str]  # (group, version, plural)
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the previous state, to turn selector exits into DELETED


class Store:
    def __init__(self) -> None:
        self.objects = kmock.ObjectsArray()
        self.resource_version = 0
        self._log: collections.deque[WatchEvent] = collections.deque(maxlen=_LOG_SIZE)
        self._changed = asyncio.Event()

    @staticmethod
    def _key(rtype: ResourceType, namespace: str | None, name: str) -> tuple[Any, str | None, str]:
        return (kmock.resource(rtype.group, rtype.version, rtype.plural), namespace, name)

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = self._key(rtype, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def list(self, rtype: ResourceType, namespace: str | None) -> list[dict[str, Any]]:
        wanted = kmock.resource(rtype.group, rtype.version, rtype.plural)
        result = [
            copy.deepcopy(obj.raw)
            for (res, ns, _), obj in self.objects.items()
            if res == wanted and not obj.deleted and (namespace is None or ns == namespace)
        ]
        return sorted(
            result, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])
        )

    def write(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a created or updated object under a new resourceVersion."""
        meta = obj["metadata"]
        key = self._key(rtype, meta.get("namespace"), meta["name"])
        old = self.get(rtype, meta.get("namespace"), meta["name"])
        self.resource_version += 1
        meta["resourceVersion"] = str(self.resource_version)
        if key in self.objects:
            history = self.objects[key].history
            history.append(copy.deepcopy(obj))
            del history[:-_HISTORY_SIZE]
        else:
            self.objects[key] = copy.deepcopy(obj)
        self._emit(rtype, "ADDED" if old is None else "MODIFIED", obj, old)
        return obj

    def remove(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        key = self._key(rtype, namespace, name)
        obj = copy.deepcopy(self.objects[key].raw)
        self.objects[key].delete()
        # The DELETED event carries a new resourceVersion, as a real server's does.
        self.resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        self._emit(rtype, "DELETED", obj, obj)
        return obj

    def _emit(
        self, rtype: ResourceType, kind: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        self._log.append(
            WatchEvent(self.resource_version, rtype.key, kind, copy.deepcopy(obj), old)
        )
        # Wake every waiting watcher; each re-reads the log from its own cursor.
        self._changed.set()
        self._changed = asyncio.Event()

    def events_since(self, resource_version: int) -> builtins.list[WatchEvent] | None:
        """Events after ``resource_version``; None if the log no longer reaches back that far."""
        # Every resourceVersion has exactly one event, so a gap means the log was trimmed.
        if self._log and self._log[0].resource_version > resource_version + 1:
            return None
        return [e for e in self._log if e.resource_version > resource_version]

    async def wait_for_change(self, timeout: float) -> None:
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
