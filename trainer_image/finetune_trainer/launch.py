"""The worker pod's command: torchrun (`torch.distributed.run`), stopping quietly on a signal.

    python -m finetune_trainer.launch <torchrun arguments> -m finetune_trainer --config ...

torchrun turns SIGTERM (every graceful pod delete, drain or preemption) into a
`SignalException`, forwards the signal to its workers and shuts them down, then lets the
exception escape: a traceback in the pod's log and exit code 1 for what is an orderly stop.
Here that stop ends with one log line and 128 + the signal (143 for SIGTERM), the code the
trainer itself exits with when stopped (`trainer.EXIT_STOPPED`) and that
`reconcile/disposition.py` reads as a preemption. Any other failure is torchrun's own,
unchanged.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        # torchrun already logged the signal and shut its workers down, waiting for them.
        print(f"torchrun stopped by {name}: worker group shut down", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
