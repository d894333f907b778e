"""`ftjob` interrupted by Ctrl-C while its imports still run: exit 130 and one line, no
traceback. Runs the console script as pip generates it from pyproject's `[project.scripts]`,
with a real SIGINT raised in the middle of importing pydantic (what the CLI imports first)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.conftest import REPO

# Raise SIGINT (Python's default handler turns it into KeyboardInterrupt) once pydantic starts
# importing: the moment a user's Ctrl-C lands in during `ftjob`'s first ~0.3 s. A process
# started in the background by a non-interactive shell (a CI runner) inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler; a user's terminal never does that, so the
# prelude restores the disposition `ftjob` gets there.
INTERRUPT_DURING_IMPORTS = """
import importlib.abc, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pydantic":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
"""


def console_script() -> str:
    """The wrapper pip writes for the `ftjob` entry point."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["ftjob"]
    module, func = spec.split(":")
    return f"import sys\nfrom {module} import {func}\nsys.exit({func}())\n"


def test_ctrl_c_during_imports_exits_130_quietly() -> None:
    for prelude, argv in ((INTERRUPT_DURING_IMPORTS, ["crd"]), ("", ["--help"])):
        proc = subprocess.run(
            [sys.executable, "-c", prelude + console_script(), *argv],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if prelude:
            assert proc.returncode == 130, proc.stderr
            assert proc.stderr == "interrupted\n" and proc.stdout == "", proc.stderr
        else:  # the same wrapper, not interrupted, is the CLI
            assert proc.returncode == 0 and "usage: ftjob" in proc.stdout, proc.stderr
