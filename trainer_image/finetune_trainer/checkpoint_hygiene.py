"""The start-up cleanup's deferred deletes (see `checkpoint_store.cleanup_plan`): how long
they wait, and the delete itself."""

from __future__ import annotations

from collections.abc import Mapping

from finetune_trainer import checkpoint_store as store
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location

# Uncommitted steps newer than every committed one are left at start (a lagging NFS view may
# hide their marker: checkpoint_store.cleanup_plan) and deleted by the first purge this long
# after that look, if their marker does not open then: twice NFS's longest default attribute
# cache lifetime (acdirmax 60 s), after which the view of the directory has been revalidated.
CLEANUP_GRACE_ENV = "FT_CHECKPOINT_CLEANUP_GRACE_SECONDS"
CLEANUP_GRACE_SECONDS = 120.0


def cleanup_grace(env: Mapping[str, str]) -> float:
    """CLEANUP_GRACE_ENV (seconds, >= 0), or the default; anything else is refused by name."""
    raw = env.get(CLEANUP_GRACE_ENV)
    if raw is None or raw.strip() == "":
        return CLEANUP_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise UnsupportedConfigError(
            f"{CLEANUP_GRACE_ENV}={raw!r}: expected a number of seconds, 0 or more"
        )
    return value


def purge_deferred(paths: list[Location]) -> list[Location]:
    """Delete the uncommitted steps the start-up cleanup left whose marker still does not
    open (only while no save is in flight: the caller runs in the commit). Returns them."""
    removed = []
    for path in paths:
        if not store.marker_opens(path):
            path.remove()
            removed.append(path)
    return removed
