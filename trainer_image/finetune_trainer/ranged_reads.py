"""Ranged GETs that survive a real object store: a bounded retry with exponential backoff and
full jitter per range, and large ranges split into parallel parts of a bounded size.

A real store throttles (S3's 503 SlowDown) and resets connections; s3fs and botocore retry
some of that, but one range that still fails would fail the whole load and restart the pod,
every rank reading again from the start. Only transient errors are retried here: a missing
object or denied access (FileNotFoundError/PermissionError, a refusal the caller names) and a
truncated object (a ValueError from its header) never come back different. A 1 GiB embedding
read whole by every DDP rank would be one GET on one connection: split into parts, the parts
go out concurrently (`cat_ranges`) and a failure costs one part, not the tensor."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fsspec import AbstractFileSystem

from finetune_operator.api.weights_reads import READ_PART_BYTES

log = logging.getLogger(__name__)

# A part of a range: large enough to amortise a request, small enough that a retry is cheap.
PART_BYTES = READ_PART_BYTES  # the planner counts it (api/weights_reads)
# Ranges of one file at most this far apart are fetched as one request, the gap dropped: a
# request costs tens of milliseconds of latency, in which a store delivers about this much.
GAP_BYTES = 1 << 20
# Errors that no retry (in this process) changes: the caller classifies them.
_FINAL = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class ShortReadError(OSError):
    """Fewer bytes than a range asked of an object that has them (a broken connection, or
    the object replaced since it was listed): may pass when asked again."""


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` per range in all; before attempt n+1 (n >= 1) a pause drawn uniformly from
    [0, min(cap_s, base_s * 2**(n-1))) (full jitter: ranks throttled together do not retry
    together). `sleep` and `rand` are injectable for tests."""

    attempts: int = 6
    base_s: float = 0.5
    cap_s: float = 20.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    rand: Callable[[], float] = field(default=random.random, compare=False)


DEFAULT_RETRY = RetryPolicy()


def backoff_s(attempt: int, base_s: float, cap_s: float, rand: float) -> float:
    """Pure: the pause after failed attempt `attempt` (1-based), `rand` in [0, 1)."""
    return rand * min(cap_s, base_s * 2 ** (attempt - 1))


def is_transient(exc: BaseException) -> bool:
    """Pure: whether asking again may succeed: a short read, a connection reset, a timeout,
    throttling (s3fs: OSError EBUSY for 503 SlowDown, EIO for other server errors), botocore's
    connection errors, a body cut mid-stream; never a missing object or a denial."""
    if isinstance(exc, _FINAL):
        return False
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    try:
        from aiohttp import ClientPayloadError
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, IncompleteReadError
    except ImportError:  # pragma: no cover - s3fs brings botocore and aiohttp
        return False
    # A connection cut part way through a GET's body reaches us as neither an OSError nor a
    # botocore connection error: aiohttp's ClientPayloadError (what s3fs raises once its own
    # retries of it are spent) or, short of the Content-Length, botocore's IncompleteReadError.
    return isinstance(
        exc, (BotoConnectionError, HTTPClientError, ClientPayloadError, IncompleteReadError)
    )


def split_range(start: int, end: int, part_bytes: int) -> list[tuple[int, int]]:
    """Pure: [start, end) as consecutive parts of at most `part_bytes` (one part if smaller;
    an empty range stays one empty part)."""
    if end - start <= part_bytes:
        return [(start, end)]
    return [(s, min(s + part_bytes, end)) for s in range(start, end, part_bytes)]


@dataclass(frozen=True)
class Request:
    """One GET's range [start, end) of `file`, serving the ranges `members` (indices into
    the ranges given to `coalesce`), each inside it."""

    file: str
    start: int
    end: int
    members: tuple[int, ...]


def coalesce(
    ranges: Sequence[tuple[str, int, int]], gap_bytes: int, limit_bytes: int
) -> list[Request]:
    """Pure: the (file, start, end) ranges as requests, in file and offset order: ranges of
    one file that overlap, touch or lie at most `gap_bytes` apart go out as one request (the
    gap read and dropped), as long as the request stays within `limit_bytes` (a range larger
    than that alone is one request, split into parts later). A rank reading many small
    tensors, or the rows of several adjacent ones, pays one request's latency, not one each."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1], ranges[i][2]))
    out: list[Request] = []
    for i in order:
        file, start, end = ranges[i]
        if out:
            last = out[-1]
            merged_end = max(last.end, end)
            if (
                last.file == file
                and start - last.end <= gap_bytes
                and merged_end - last.start <= limit_bytes
            ):
                out[-1] = Request(file, last.start, merged_end, (*last.members, i))
                continue
        out.append(Request(file, start, end, (i,)))
    return out


def dropped_bytes(requests: Sequence[Request], ranges: Sequence[tuple[str, int, int]]) -> int:
    """Pure: the bytes the requests fetch that none of their ranges covers (the gaps that
    coalescing reads and drops)."""
    total = 0
    for req in requests:
        covered, reach = 0, req.start
        for i in sorted(req.members, key=lambda i: ranges[i][1]):
            _, start, end = ranges[i]
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        total += (req.end - req.start) - covered
    return total


def cat_ranges_retrying(
    fs: AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    urls: Sequence[str],
    policy: RetryPolicy = DEFAULT_RETRY,
) -> list[bytes]:
    """The bytes of each range, fetched concurrently; a range that fails transiently (or
    comes back short) is asked again, alone with the others that failed, up to
    `policy.attempts` times; a final error, or the last transient one, is raised (a short
    read as ShortReadError naming `urls[i]`)."""
    out: list[bytes | None] = [None] * len(paths)
    pending = list(range(len(paths)))
    for attempt in range(1, policy.attempts + 1):
        got = fs.cat_ranges(
            [paths[i] for i in pending], [starts[i] for i in pending], [ends[i] for i in pending]
        )
        failed: list[tuple[int, BaseException]] = []
        for i, data in zip(pending, got, strict=True):
            if isinstance(data, BaseException):
                failed.append((i, data))
            elif len(data) != ends[i] - starts[i]:
                failed.append((i, ShortReadError(
                    f"{urls[i]}: read {len(data)} bytes of {ends[i] - starts[i]} at "
                    f"{starts[i]} (a truncated read, or the object replaced since it was "
                    "listed)"
                )))  # fmt: skip
            else:
                out[i] = bytes(data)
        if not failed:
            break
        for _, exc in failed:
            if not is_transient(exc):
                raise exc
        if attempt == policy.attempts:
            raise failed[0][1]
        pause = backoff_s(attempt, policy.base_s, policy.cap_s, policy.rand())
        log.warning(
            "%d of %d ranges failed (attempt %d of %d: %s); again in %.2f s",
            len(failed), len(pending), attempt, policy.attempts, failed[0][1], pause,
        )  # fmt: skip
        policy.sleep(pause)
        pending = [i for i, _ in failed]
    done = [b for b in out if b is not None]
    assert len(done) == len(out)
    return done
