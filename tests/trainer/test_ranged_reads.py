"""Ranged reads that survive throttling and connection resets (finetune_trainer.ranged_reads):
the pure parts, and the reader over an fsspec filesystem with faults injected per range."""

from __future__ import annotations

import errno
import uuid
from collections.abc import Callable

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from aiohttp import ClientPayloadError
from botocore.exceptions import IncompleteReadError
from safetensors.torch import save

from finetune_trainer.location import Location, access_problem, credentials_expired
from finetune_trainer.ranged_reads import (
    RetryPolicy,
    ShortReadError,
    backoff_s,
    is_transient,
    split_range,
)
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader

SLOW_DOWN = OSError(errno.EBUSY, "Please reduce your request rate.")  # s3fs's 503 SlowDown
# A connection cut mid-body, as s3fs raises it once its own retries are spent (measured
# against a server that closes the connection part way through a 206's body).
CUT_BODY = ClientPayloadError(
    "Response payload is not completed: <ContentLengthError: 400, message='Not enough data "
    "to satisfy content length header (received 100 of 1000 bytes).'>"
)


def test_backoff_doubles_up_to_the_cap_scaled_by_the_jitter() -> None:
    assert [backoff_s(n, 0.5, 3.0, 1.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_s(3, 0.5, 3.0, 0.25) == 0.5
    assert backoff_s(1, 0.5, 3.0, 0.0) == 0.0


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (SLOW_DOWN, True),
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError(), True),
        (ShortReadError("read 3 of 4"), True),
        (OSError(errno.EIO, "InternalError"), True),
        (CUT_BODY, True),
        (IncompleteReadError(actual_bytes=100, expected_bytes=1000), True),
        (FileNotFoundError("NoSuchKey"), False),
        (PermissionError("AccessDenied"), False),
        (ValueError("truncated: upload it again"), False),
    ],
)
def test_only_transient_errors_are_retried(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_a_large_range_is_split_into_bounded_consecutive_parts() -> None:
    assert split_range(10, 35, 10) == [(10, 20), (20, 30), (30, 35)]
    assert split_range(10, 20, 10) == [(10, 20)]
    assert split_range(5, 5, 10) == [(5, 5)]


class Faults:
    """Wraps `fs.cat_ranges`: the first `times` requests of each range that `hit` selects
    return `error` (as fsspec does with on_error="return") or come back one byte short."""

    def __init__(self, fs: fsspec.AbstractFileSystem, hit: Callable[[int, int], bool],
                 error: BaseException | None, times: int = 1) -> None:  # fmt: skip
        self.original = fs.cat_ranges
        self.hit, self.error, self.times = hit, error, times
        self.seen: dict[tuple[str, int, int], int] = {}
        self.requests: list[tuple[int, int]] = []

    def __call__(self, paths: list[str], starts: list[int], ends: list[int],
                 **kw: object) -> list[object]:  # fmt: skip
        got: list[object] = list(self.original(paths, starts, ends, **kw))
        for k, key in enumerate(zip(paths, starts, ends, strict=True)):
            self.requests.append(key[1:])
            if not self.hit(key[1], key[2]):
                continue
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] <= self.times:
                data = got[k]
                assert isinstance(data, bytes)
                got[k] = self.error if self.error is not None else data[:-1]
        return got


def model_on(fs: fsspec.AbstractFileSystem) -> tuple[Location, dict[str, torch.Tensor]]:
    tensors = {
        "embed.weight": torch.arange(64 * 16, dtype=torch.float32).view(64, 16),
        "norm.weight": torch.linspace(0, 1, 16),
    }
    root = f"/model-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{root}/model.safetensors", save(tensors))
    return Location(fs, root, {}), tensors


def load(location: Location, **kw: object) -> tuple[dict[str, torch.Tensor], list[float]]:
    pauses: list[float] = []
    policy = RetryPolicy(attempts=3, sleep=pauses.append, rand=lambda: 0.5)
    state = {"embed.weight": torch.zeros(64, 16), "norm.weight": torch.zeros(16)}
    reader = RangedSafetensorsReader(location, retry=policy, **kw)  # type: ignore[arg-type]
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state, pauses


@pytest.mark.parametrize(
    "error",
    [SLOW_DOWN, ConnectionResetError(errno.ECONNRESET, "reset"), CUT_BODY, None],
    ids=["slowdown", "reset", "cut-body", "short"],
)
def test_a_range_that_fails_transiently_is_asked_again_after_a_pause(
    error: BaseException | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = fsspec.filesystem("memory")  # one cached instance: patched through monkeypatch
    location, want = model_on(fs)
    # Fail the parts of the embedding (4 KiB in parts of 1 KiB) the first time they are asked.
    faults = Faults(fs, hit=lambda s, e: e - s == 1024, error=error)
    monkeypatch.setattr(fs, "cat_ranges", faults)
    state, pauses = load(location, part_bytes=1024)
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert len(faults.seen) == 4 and set(faults.seen.values()) == {2}
    assert pauses == [0.25]  # one pause for the failed batch, backoff 0.5 x jitter 0.5


def test_a_large_range_goes_out_as_parallel_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    location, want = model_on(fs)
    faults = Faults(fs, hit=lambda s, e: False, error=None)
    monkeypatch.setattr(fs, "cat_ranges", faults)
    state, _ = load(location, part_bytes=1000)
    assert all(torch.equal(state[k], want[k]) for k in want)
    sizes = sorted(e - s for s, e in faults.requests)
    assert max(sizes) == 1000 and sizes.count(1000) == 4 and 96 in sizes  # 4096 = 4 x 1000 + 96


def test_a_range_that_keeps_failing_raises_after_the_last_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fs = fsspec.filesystem("memory")
    location, _ = model_on(fs)
    # The embedding and the norm after it, coalesced into one request.
    faults = Faults(fs, hit=lambda s, e: e - s == 4096 + 64, error=SLOW_DOWN, times=99)
    monkeypatch.setattr(fs, "cat_ranges", faults)
    with pytest.raises(BaseException) as err:
        load(location)
    assert "reduce your request rate" in str(err.value)
    assert list(faults.seen.values()) == [3]  # RetryPolicy(attempts=3)


def test_a_denial_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    location, _ = model_on(fs)
    faults = Faults(fs, hit=lambda s, e: e - s == 4160, error=PermissionError("AccessDenied"))
    monkeypatch.setattr(fs, "cat_ranges", faults)
    with pytest.raises(BaseException) as err:
        load(location)
    assert "AccessDenied" in str(err.value)
    assert list(faults.seen.values()) == [1]


# ---- expired credentials: transient, unlike a denial --------------------------------------


@pytest.mark.parametrize(
    ("code", "text", "expired"),
    [
        ("ExpiredToken", "The provided token has expired.", True),
        (None, "The provided token has expired.", True),
        (None, "An error occurred (ExpiredToken) when calling the GetObject operation", True),
        (None, "The security token included in the request is expired", True),
        ("RequestExpired", "Request has expired", True),
        ("AccessDenied", "Access Denied", False),
        ("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist", False),
        ("SignatureDoesNotMatch", "The request signature we calculated does not match", False),
    ],
)
def test_expired_credentials_are_told_from_a_denial(
    code: str | None, text: str, expired: bool
) -> None:
    assert credentials_expired(code, text) is expired


def test_an_expired_token_is_no_refusal_but_access_denied_is() -> None:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    def s3_error(code: str, message: str) -> BaseException:
        error = ClientError({"Error": {"Code": code, "Message": message}}, "GetObject")
        return translate_boto_error(error)

    expired = s3_error("ExpiredToken", "The provided token has expired.")
    denied = s3_error("AccessDenied", "Access Denied")
    # s3fs maps both to PermissionError; only the denial is the job's configuration.
    assert isinstance(expired, PermissionError) and isinstance(denied, PermissionError)
    assert access_problem(expired) is None
    assert access_problem(denied) is not None and "access denied" in str(access_problem(denied))
    assert not is_transient(expired)  # not retried in-process: the restart reads it anew
