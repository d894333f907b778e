"""The exception types a trainer refuses to start with (exit code 2: restarting cannot help)."""

from __future__ import annotations


class UnsupportedConfigError(ValueError):
    """The job asks for something this trainer refuses; the message names the field to change."""


class UnsupportedRuntimeError(UnsupportedConfigError):
    """The image's libraries cannot run this trainer (a torch older than its floor)."""
