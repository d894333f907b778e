"""The oldest torch this trainer runs on, checked at start with a message that says why.

2.11 is the oldest release the trainer is run on (the GPU benchmark machine; CI and the image
use 2.13). What it relies on: FSDP2's public `fully_shard`/`MixedPrecisionPolicy`/
`OffloadPolicy` (2.6+), DTensor's public module (2.5+), DCP `get_state_dict`/`set_state_dict`
(2.2+) and DDP arguments that differ across releases (passed only where supported, see
`parallelize`). Releases 2.6 to 2.10 may work but were never run, so they are refused rather
than failing in the middle of a job.
"""

from __future__ import annotations

import re

from finetune_trainer.errors import UnsupportedRuntimeError

TORCH_FLOOR = (2, 11)


def parse_version(version: str) -> tuple[int, int]:
    """'2.11.0+cu130' -> (2, 11); anything unparsable is refused by `check_torch`."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedRuntimeError(f"cannot read the torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch(version: str) -> None:
    if parse_version(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise UnsupportedRuntimeError(
            f"torch {version} is older than {floor}, the oldest release this trainer is run "
            f"on (it needs FSDP2's public API and the DCP/DDP behaviour of {floor}+); use a "
            f"trainer image with torch>={floor}"
        )
