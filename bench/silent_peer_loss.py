"""Silent peer loss: from a frozen pod to the survivors' failure, and on to the resume, per
collective timeout (the old fixed 600 s against the one derived for the job).

    python bench/silent_peer_loss.py                    # derived (this plan: 60 s) and 600 s
    python bench/silent_peer_loss.py --timeouts 60 600

Two elastic agents of the quickstart trainer (real torchrun, gloo, CPU) on the standalone
rendezvous store, with the operator's worker rendezvous conf; one pod's processes frozen with
SIGSTOP mid-interval (power loss or partition: its sockets stay open). Printed per timeout: the
seconds from the freeze to the survivor's collective failing, and to its resume at world 1
(keep-alive expiry, the derived last call, the new worker's start and checkpoint load). The
timeout is applied through `faultTolerance.collectiveTimeoutSeconds`, the path a derived value
takes too; `derived` is what `api/elastic_timeouts.py` gives this plan.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.trainer.silent_loss: the scenario the slow test runs

from finetune_operator.api.elastic_timeouts import steady_collective_seconds  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.trainer.conftest import Proc, make_job  # noqa: E402
from tests.trainer.silent_loss import (  # noqa: E402
    process_tree,
    seconds_to_failure,
    silent_loss_job,
    start_and_freeze,
)


def measure(timeout_s: int) -> tuple[float, float]:
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="silent-loss-") as tmp:
        run = start_and_freeze(Path(tmp), procs, silent_loss_job(timeout_s))
        try:
            failed = seconds_to_failure(run, timeout=timeout_s + 120)
            log = run.survivor.log
            wait_until(lambda: re.search(r"resumed from checkpoint step", log.read_text()),
                       "resume at world 1", 180)  # fmt: skip
            resumed = time.monotonic() - run.frozen_at
        finally:
            for pid in process_tree(run.frozen.popen.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for p in procs:
                p.close()
    return failed, resumed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeouts", type=int, nargs="*")
    args = parser.parse_args()
    job = make_job()
    derived = int(steady_collective_seconds(job.spec, job.plan))
    rows = []
    for t in args.timeouts or [derived, 600]:
        failed, resumed = measure(t)
        name = "old fixed" if t == 600 else "derived" if t == derived else "set"
        rows.append(f"| {name} {t} s | {failed:.1f} s | {resumed:.1f} s |")
        print(rows[-1], flush=True)
    print("| collective timeout | freeze -> survivor fails | freeze -> resumed at world 1 |")
    print("|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
