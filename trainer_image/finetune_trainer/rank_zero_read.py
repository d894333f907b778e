"""A read that rank 0 does for every rank: its result, or its error, broadcast.

What every rank would otherwise read alike from an object store (the safetensors headers:
two latency-bound GETs per file per rank, 3,840 requests at 64 ranks and 30 files, again at
each of a striped load's DCP loads) is read once per job. Only for callers that every rank of
the default group reaches in the same order (inside a DCP load on that group, or ZeRO-3's
module fill, itself a sequence of collectives): the broadcast is a collective."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

T = TypeVar("T")


def _shareable(e: Exception) -> Exception:
    """`e`, or, when it does not survive pickling (some client libraries' errors), an
    OSError with its text: the other ranks fail with the message either way, and as a read
    error a restart may pass, rank 0 classifying its own."""
    try:
        back = pickle.loads(pickle.dumps(e))
    except Exception:
        return OSError(f"{type(e).__name__}: {e}")
    return cast(Exception, back)


def read_on_rank0(read: Callable[[], T]) -> T:
    """`read()` on rank 0 of the default group, its result on every rank (a picklable
    value); an error rank 0 met is raised on every rank, so no rank is left waiting and all
    report the same reason. Not distributed (or one rank): `read()` here."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return read()
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, read())
        except Exception as e:
            error = e
            box[0] = (False, _shareable(e))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error  # rank 0's own, with its traceback
    ok, value = box[0]
    if not ok:
        raise value
    return cast(T, value)
