"""Hypothesis profiles: `ci` (default) keeps the fuzz under a minute on 2 shared cores;
`HYPOTHESIS_PROFILE=dev` runs many more examples locally."""

from __future__ import annotations

import os
from datetime import timedelta

from hypothesis import HealthCheck, settings

_COMMON = {
    # A per-example deadline far above a normal example (~10-100 ms): a real hang or a
    # quadratic blow-up fails the example instead of stalling the suite.
    "deadline": timedelta(seconds=20),
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=300, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
