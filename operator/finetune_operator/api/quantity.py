"""Byte quantities in the spec (`dataset.cacheSizeLimit`): the Kubernetes forms a pod's
`sizeLimit` and `ephemeral-storage` take, parsed here so a bad one is refused naming the field
instead of failing the pod's creation later."""

from __future__ import annotations

import re
from typing import Final

# Plain decimal numbers with an optional binary or decimal suffix: what people write for sizes.
# (Kubernetes also takes exponents, `1e9`, and milli-units, `500m`: nonsense for a disk size.)
BYTES_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_BYTES = re.compile(BYTES_PATTERN)
# The suffixes a Kubernetes quantity takes for a byte count (the planner reads memory with
# them too: planner/hardware.py).
UNITS: Final = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}


def quantity_bytes(text: str, field: str) -> int:
    """`text` in bytes, or ValueError naming `field` (pydantic reports it as the field's error)."""
    match = _BYTES.match(text.strip())
    if not match:
        raise ValueError(
            f"{field} {text!r} is not a byte quantity such as 32Gi, 500Mi or 20G "
            "(digits, an optional fraction, an optional Ki/Mi/Gi/Ti/Pi/Ei or k/M/G/T/P/E suffix)"
        )
    number, suffix = text.strip().removesuffix(match.group(2) or ""), match.group(2) or ""
    whole, _, fraction = number.partition(".")
    scale = UNITS[suffix]
    # Exact integer arithmetic: 1.5Gi is 1610612736, not a float's rounding of it.
    return int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)
