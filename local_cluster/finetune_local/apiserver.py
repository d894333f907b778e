"""The Kubernetes API emulator: kmock's ``KubernetesEmulator`` made faithful enough for kopf,
the ``kubernetes`` client and ``kubectl``.

kmock gives the HTTP server (:class:`kmock.Server`), the request model, the reaction DSL (tests
can still inject faults: ``server['get /api/v1/pods'] << 500`` wins over the emulation), the
object store and ``Status`` error rendering. This subclass replaces its naive state handling (a
plain dict merge without resourceVersions) with the rules in :mod:`.apiobjects`, and serves
discovery, watches, Tables and pod logs itself (see :mod:`.apiroutes` for the read side).
"""

from __future__ import annotations

import json
import logging
import pathlib
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from finetune_local.apiobjects import ObjectService
from finetune_local.apiresources import Registry
from finetune_local.apiroutes import ApiPath, Reply, parse_api_path, serve
from finetune_local.apistore import ApiError, Store

logger = logging.getLogger(__name__)

LogReader = Callable[[str, str, "str | None"], "pathlib.Path | None"]
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_KEEP_REQUESTS = 500  # kmock records every request for assertions; bound it for long runs


def _action(method: str, path: ApiPath | None, params: dict[str, str]) -> kmock.action | None:
    if path is None or path.plural is None:
        return None
    if method == "GET":
        return (
            kmock.action.WATCH
            if params.get("watch") in ("true", "1")
            else (kmock.action.FETCH if path.name else kmock.action.LIST)
        )
    return {
        "POST": kmock.action.CREATE,
        "PATCH": kmock.action.UPDATE,
        "PUT": kmock.action.UPDATE,
        "DELETE": kmock.action.DELETE,
    }.get(method)


def _refuse_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's json accepts them; Go's does not)."""
    raise ValueError(f"invalid character in numeric literal: {name}")


def status_body(code: int, reason: str, message: str, details: Any) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details or {},
        "code": code,
    }


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """Serve with ``async with ApiServer() as api, kmock.Server(api) as server: ...``."""

    registry: Registry = attrs.field(factory=Registry)
    log_reader: LogReader | None = None
    store: Store = attrs.field(init=False)
    service: ObjectService = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # Deliberately not calling super().__attrs_post_init__(): it registers kmock's naive
        # fallback reactions, which this class replaces (see _handle). Tests may still add
        # reactions of their own; those take precedence over the emulation.
        self.store = Store()
        self.service = ObjectService(self.store, self.registry)
        # The namespaces a real API server makes at start (its system namespaces controller):
        # kube-node-lease holds each node's Lease, the kubelet's heartbeat.
        for namespace in SYSTEM_NAMESPACES:
            self.service.create(
                self._type("", "v1", "namespaces"), None, {"metadata": {"name": namespace}}
            )

    def _type(self, group: str, version: str, plural: str) -> Any:
        rtype = self.registry.get(group, version, plural)
        assert rtype is not None
        return rtype

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Parse the request ourselves (kmock's parser fails on ``/api/v1/namespaces``)."""
        body = await raw_request.read()
        if any(kind in raw_request.content_type for kind in ("protobuf", "cbor")):
            # JSON only. client-go (kubectl) retries a 415 for protobuf with JSON.
            return aiohttp.web.json_response(
                status_body(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - "
                    "accepted media types include: application/json, application/yaml",
                    {},
                ),
                status=415,
            )
        text = body.decode("utf-8", errors="replace")
        data: Any = None
        if text.strip():
            try:
                data = json.loads(text, parse_constant=_refuse_constant)
            except RecursionError:
                data = None  # deeper than any object needs: refused as malformed (400)
            except ValueError:
                if "yaml" in raw_request.content_type:  # server-side apply sends YAML
                    try:
                        data = yaml.safe_load(text)
                    except (yaml.YAMLError, RecursionError):
                        data = None
        params = dict(raw_request.query)
        path = parse_api_path(raw_request.path)
        request = kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=params,
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=text,
            data=data,
            action=_action(raw_request.method, path, params),
            resource=kmock.resource(path.group, path.version, path.plural) if path else None,
            namespace=path.namespace if path else None,
            name=path.name if path else None,
            subresource=path.subresource if path else None,
        )
        self._remember(request)
        try:
            return await self._handle(request)
        except Exception as exc:
            return await self._render_error(exc)

    def _remember(self, request: kmock.Request) -> None:
        self._requests.append(request)
        if len(self._requests) > 2 * _KEEP_REQUESTS:
            del self._requests[:-_KEEP_REQUESTS]
            for payload in self._payloads:
                requests = getattr(payload, "_requests", None)
                if isinstance(requests, list):
                    del requests[:-_KEEP_REQUESTS]

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: its state changes are replaced by ObjectService.
        # User-added reactions first; kmock raises NotImplementedError when none matches.
        try:
            return await kmock.RawHandler._handle(self, request)
        except NotImplementedError:
            pass
        result = await serve(self, request)
        if self.service.garbage_pending:
            # Background propagation: dependents go after the owner's change, as with the GC.
            self.service.collect_garbage()
        if isinstance(result, Reply):
            if result.content_type == "application/json":
                return aiohttp.web.json_response(result.body, status=result.status)
            return aiohttp.web.Response(
                text=str(result.body), status=result.status, content_type=result.content_type
            )
        if isinstance(result, AsyncIterator):
            return await self._stream(request, result)
        return aiohttp.web.json_response(result)

    async def _stream(
        self, request: kmock.Request, events: AsyncIterator[Any]
    ) -> aiohttp.web.StreamResponse:
        assert request._raw_request is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)  # headers now: clients wait for them
        try:
            try:
                async for item in events:
                    await response.write(json.dumps(item).encode() + b"\n")
            except ApiError as exc:  # e.g. 410 Gone: told as an ERROR event, as a real server does
                await self._stream_error(exc, response)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        return response

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, ApiError):
            body = status_body(exc.status, exc.reason or "", exc.message or "", exc.details)
            return aiohttp.web.json_response(body, status=exc.status)
        logger.error("API emulator failure:\n%s", "".join(traceback.format_exception(exc)))
        return aiohttp.web.json_response(
            status_body(500, "InternalError", f"emulator failure: {exc!r}", {}), status=500
        )

    async def _stream_error(self, exc: Exception, raw_response: aiohttp.web.StreamResponse) -> None:
        code = exc.status if isinstance(exc, ApiError) else 500
        body = status_body(
            code,
            getattr(exc, "reason", None) or "InternalError",
            getattr(exc, "message", None) or repr(exc),
            {},
        )
        await raw_response.write(json.dumps({"type": "ERROR", "object": body}).encode() + b"\n")
