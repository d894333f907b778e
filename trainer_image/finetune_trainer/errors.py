"""The one exception type a job's configuration can raise at start."""

from __future__ import annotations


class UnsupportedConfigError(ValueError):
    """The job asks for something this trainer refuses; the message names the field to change."""
