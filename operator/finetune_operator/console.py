"""The `ftjob` console script (pyproject `[project.scripts]`).

Ctrl-C at any moment ends `ftjob` with one line and exit 130, as a shell reports a tool
stopped by SIGINT, never a traceback. The CLI's own handler covers the commands; this entry
point also covers the first ~0.3 s, while the CLI's imports (pydantic, the API models) run,
which the handler inside `cli.main` cannot: the console-script wrapper imports the module
that holds its function before calling it, so that module imports nothing heavy itself.
"""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT


def main() -> int:
    try:
        from finetune_operator.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
