"""A small async JSON client of the Kubernetes API, used by the local kubelet.

The kubelet talks to the emulator over HTTP like a real kubelet talks to its API server, so
what it does is visible to (and raced by) the operator exactly as on a cluster.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


class ApiStatusError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(
            f"HTTP {status}: {body.get('message') if isinstance(body, dict) else body}"
        )
        self.status = status
        self.body = body


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


class RestClient:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RestClient:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use RestClient as an async context manager"
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method,
            self.base_url + path,
            data=data,
            params=params,
            headers={"Content-Type": content_type},
        ) as response:
            text = await response.text()
            payload = json.loads(text) if text.strip().startswith(("{", "[")) else text
            if response.status >= 400:
                raise ApiStatusError(response.status, payload)
            return payload

    async def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Any) -> Any:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, patch: Any) -> Any:
        return await self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(
        self, path: str, grace_period_seconds: int | None = None, uid: str | None = None
    ) -> Any:
        """Delete; `uid`: only that very object (a precondition: 409 for another)."""
        body: dict[str, Any] = {}
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        return await self.request("DELETE", path, body or None)

    async def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield watch events from ``resource_version`` until the server ends the stream."""
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            "allowWatchBookmarks": "true",
        }
        async with self.session.get(self.base_url + path, params=params) as response:
            if response.status >= 400:
                raise ApiStatusError(response.status, await response.text())
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)
