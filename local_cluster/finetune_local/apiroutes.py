"""Request routing of the emulator: discovery, CRUD verbs, list/watch, Tables, pod logs."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kmock

from finetune_local import apitables
from finetune_local.apiresources import ResourceType
from finetune_local.apistore import ApiError, bad_request
from finetune_local.selectors import (
    SelectorError,
    fields_match,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)

if TYPE_CHECKING:
    from finetune_local.apiserver import ApiServer

_BOOKMARK_SECONDS = 20.0  # real servers send bookmarks about once a minute; kopf asks for them
_POLL_SECONDS = 2.0  # how often an idle watch checks whether its client went away
_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-finetune-local",
    "gitTreeState": "clean",
    "goVersion": "emulated",
    "compiler": "python",
    "platform": "linux/amd64",
    "buildDate": "2025-01-01T00:00:00Z",
    "gitCommit": "",
}


@dataclass(frozen=True)
class ApiPath:
    """A resource URL: /api/v1/... or /apis/<group>/<version>/..."""

    group: str
    version: str
    plural: str | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse_api_path(path: str) -> ApiPath | None:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    # /namespaces/<ns>/<plural>/... is namespaced; /namespaces/<name>[/status|/finalize] is the
    # Namespace object itself (kmock's own parser cannot tell these apart, hence this one).
    if (
        len(rest) >= 3
        and rest[0] == "namespaces"
        and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return ApiPath(group, version)
    return ApiPath(
        group,
        version,
        rest[0],
        namespace,
        rest[1] if len(rest) > 1 else None,
        "/".join(rest[2:]) or None,
    )


@dataclass(frozen=True)
class Reply:
    """A non-default response: a status other than 200 or a body that is not JSON."""

    body: Any
    status: int = 200
    content_type: str = "application/json"


def _not_found(path: str) -> ApiError:
    return ApiError(
        404, "NotFound", "the server could not find the requested resource", {"path": path}
    )


async def serve(server: ApiServer, request: kmock.Request) -> Any:
    path = request.url.path.rstrip("/") or "/"
    if path == "/version":
        return _VERSION
    if path == "/api":
        host = f"{request.url.host}:{request.url.port}"
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}],
        }
    if path == "/apis":
        return server.registry.api_group_list()
    if path == "/openapi/v3":
        return server.registry.openapi_index()
    if path.startswith("/openapi/v3/"):
        parts = path.removeprefix("/openapi/v3/").split("/")
        group, version = ("", parts[-1]) if parts[0] == "api" else (parts[1], parts[-1])
        document = server.registry.openapi_document(group, version)
        if document is None:
            raise _not_found(path)
        return document
    if path in ("/", "/healthz", "/livez", "/readyz"):
        return {"paths": ["/api", "/api/v1", "/apis", "/version"]} if path == "/" else "ok"
    api = parse_api_path(path)
    if api is None:
        raise _not_found(path)
    if api.plural is None:
        document = (
            server.registry.api_resource_list(api.group, api.version)
            if api.version
            else server.registry.api_group(api.group)
        )
        if document is None:
            raise _not_found(path)
        return document
    if (
        api.group
        and api.version
        and api.plural
        and not api.name
        and api.namespace is None
        and server.registry.api_group(api.group) is None
    ):
        raise _not_found(path)
    rtype = server.registry.get(api.group, api.version, api.plural)
    if rtype is None:
        raise _not_found(path)
    namespace = api.namespace if rtype.namespaced else None
    return await _serve_resource(server, request, rtype, namespace, api.name, api.subresource)


async def _serve_resource(
    server: ApiServer,
    request: kmock.Request,
    rtype: ResourceType,
    namespace: str | None,
    name: str | None,
    subresource: str | None,
) -> Any:
    service, params, method = server.service, dict(request.params), str(request.method.value)
    if subresource not in (None, "status", "log"):
        raise _not_found(request.url.path)
    if subresource == "status" and not rtype.status_subresource:
        raise _not_found(request.url.path)
    if name is None:
        if method == "GET" and params.get("watch") in ("true", "1"):
            return _watch(server, request, rtype, namespace, params)
        if method == "GET":
            return _list(server, request, rtype, namespace, params)
        if method == "POST":
            _check_strict_fields(rtype, params, request.data)
            created = service.create(rtype, namespace, request.data)
            return Reply(created, 201)
        if method == "DELETE":
            items = _select(server, rtype, namespace, params)
            for obj in items:
                service.delete(rtype, namespace, obj["metadata"]["name"], _delete_options(request))
            return {
                "kind": f"{rtype.kind}List",
                "apiVersion": rtype.api_version,
                "metadata": {"resourceVersion": str(server.store.resource_version)},
                "items": items,
            }
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection", {})
    if method == "GET" and params.get("watch") in ("true", "1"):
        params["fieldSelector"] = ",".join(
            filter(None, [params.get("fieldSelector"), f"metadata.name={name}"])
        )
        return _watch(server, request, rtype, namespace, params)
    if subresource == "log":
        return _pod_log(server, rtype, namespace, name, params)
    if method == "GET":
        obj = service.get(rtype, namespace, name)
        if apitables.wants_table(request.headers.get("Accept", "")):
            return _table(server, rtype, [obj], params)
        return obj
    if method == "PUT":
        _check_strict_fields(rtype, params, request.data)
        return service.replace(rtype, namespace, name, request.data, subresource)
    if method == "PATCH":
        content_type = request.headers.get("Content-Type", "application/merge-patch+json")
        if "apply-patch" in content_type and server.store.get(rtype, namespace, name) is None:
            return Reply(service.create(rtype, namespace, request.data), 201)
        return service.patch(rtype, namespace, name, request.data, content_type, subresource)
    if method == "DELETE":
        return service.delete(rtype, namespace, name, _delete_options(request))
    raise ApiError(405, "MethodNotAllowed", f"{method} is not supported", {})


def _check_strict_fields(rtype: ResourceType, params: dict[str, str], body: Any) -> None:
    """``fieldValidation=Strict`` (what kubectl sends by default): unknown fields of a custom
    resource are refused with 400 instead of pruned, in the real server's words."""
    if (
        params.get("fieldValidation") != "Strict"
        or rtype.schema is None
        or not isinstance(body, dict)
    ):
        return
    unknown = rtype.schema.unknown_fields(body)
    if unknown:
        fields = ", ".join(f'unknown field "{path}"' for path in unknown)
        raise ApiError(
            400,
            "BadRequest",
            f'{rtype.kind} in version "{rtype.version}" cannot be '
            f"handled as a {rtype.kind}: strict decoding error: {fields}",
            {},
        )


def _delete_options(request: kmock.Request) -> dict[str, Any]:
    options: dict[str, Any] = dict(request.data) if isinstance(request.data, dict) else {}
    for key in ("gracePeriodSeconds", "propagationPolicy"):
        if key in request.params:
            options[key] = request.params[key]
    return options


def _selectors(params: dict[str, str]) -> tuple[Any, Any]:
    try:
        return parse_label_selector(params.get("labelSelector")), parse_field_selector(
            params.get("fieldSelector")
        )
    except SelectorError as exc:
        raise bad_request(str(exc)) from exc


def _select(
    server: ApiServer, rtype: ResourceType, namespace: str | None, params: dict[str, str]
) -> list[dict[str, Any]]:
    labels, fields = _selectors(params)
    return [
        o
        for o in server.store.list(rtype, namespace)
        if labels_match(labels, o) and fields_match(fields, o)
    ]


def _table(
    server: ApiServer, rtype: ResourceType, items: list[dict[str, Any]], params: dict[str, str]
) -> Any:
    table = apitables.to_table(
        rtype,
        items,
        str(server.store.resource_version),
        params.get("includeObject", "Metadata"),
        datetime.datetime.now(datetime.UTC),
    )
    return table


def _list(
    server: ApiServer,
    request: kmock.Request,
    rtype: ResourceType,
    namespace: str | None,
    params: dict[str, str],
) -> Any:
    items = _select(server, rtype, namespace, params)
    if apitables.wants_table(request.headers.get("Accept", "")):
        return _table(server, rtype, items, params)
    # kind/apiVersion on lists are what kubectl decodes by ("Object 'Kind' is missing" otherwise).
    return {
        "kind": f"{rtype.kind}List",
        "apiVersion": rtype.api_version,
        "metadata": {"resourceVersion": str(server.store.resource_version)},
        "items": items,
    }


async def _watch(
    server: ApiServer,
    request: kmock.Request,
    rtype: ResourceType,
    namespace: str | None,
    params: dict[str, str],
) -> AsyncIterator[Any]:
    labels, fields = _selectors(params)
    as_table = apitables.wants_table(request.headers.get("Accept", ""))
    store = server.store
    loop = asyncio.get_running_loop()
    deadline = loop.time() + float(params.get("timeoutSeconds") or 1800)
    since = params.get("resourceVersion") or "0"
    initial = since == "0" or params.get("sendInitialEvents") == "true"

    def matches(obj: dict[str, Any] | None) -> bool:
        if obj is None or (namespace is not None and obj["metadata"].get("namespace") != namespace):
            return False
        return labels_match(labels, obj) and fields_match(fields, obj)

    def event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        if as_table:
            obj = apitables.to_table(
                rtype,
                [obj],
                obj["metadata"]["resourceVersion"],
                params.get("includeObject", "Metadata"),
                datetime.datetime.now(datetime.UTC),
            )
        return {"type": kind, "object": obj}

    def bookmark(annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"resourceVersion": str(store.resource_version)}
        if annotations:
            meta["annotations"] = annotations
        return {
            "type": "BOOKMARK",
            "object": {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": meta},
        }

    if initial:
        cursor = store.resource_version
        for obj in store.list(rtype, namespace):
            if matches(obj):
                yield event("ADDED", obj)
        if params.get("sendInitialEvents") == "true":
            yield bookmark({"k8s.io/initial-events-end": "true"})
    else:
        try:
            cursor = int(since)
        except ValueError as exc:
            raise bad_request(f"invalid resourceVersion {since!r}") from exc
    last_bookmark = loop.time()
    while True:
        events = store.events_since(cursor)
        if events is None:
            raise ApiError(410, "Expired", f"too old resource version: {cursor}", {})
        for change in events:
            cursor = change.resource_version
            if change.key != rtype.key:
                continue
            was, now = matches(change.old), change.type != "DELETED" and matches(change.obj)
            # A change that moves an object into or out of the selection is an ADDED or DELETED
            # for this watcher, as the real server's watch cache reports it.
            if now:
                yield event("MODIFIED" if was and change.type != "ADDED" else "ADDED", change.obj)
            elif was:
                yield event("DELETED", change.obj)
        transport = request._raw_request.transport if request._raw_request else None
        remaining = deadline - loop.time()
        if remaining <= 0 or transport is None or transport.is_closing():
            return
        if (
            params.get("allowWatchBookmarks") == "true"
            and loop.time() - last_bookmark > _BOOKMARK_SECONDS
        ):
            last_bookmark = loop.time()
            yield bookmark()
        await store.wait_for_change(min(remaining, _POLL_SECONDS))


def _pod_log(
    server: ApiServer, rtype: ResourceType, namespace: str | None, name: str, params: dict[str, str]
) -> Any:
    if rtype.kind != "Pod" or rtype.group:
        raise bad_request("logs are served for pods only")
    server.service.get(rtype, namespace, name)  # 404 for an unknown pod
    path = (
        server.log_reader(namespace or "", name, params.get("container"))
        if server.log_reader
        else None
    )
    text = path.read_text(errors="replace") if path is not None and path.exists() else ""
    if params.get("tailLines"):
        text = "".join(text.splitlines(keepends=True)[-int(params["tailLines"]) :])
    return Reply(text, content_type="text/plain")
