"""How a training run ends: the final checkpoint, and the exit code torchrun and the operator
read from it (finished, stopped by a signal, stopped for a peer, or a failed final save)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from finetune_trainer.checkpointer import Checkpointer
from finetune_trainer.stop_signal import StopSignal

log = logging.getLogger(__name__)

# Exit code of a rank that stopped because a *peer* was told to stop (eviction of another
# pod): non-zero so torchrun restarts this worker group, which re-forms without the peer.
EXIT_PEER_STOPPED = 75
# Exit code of a run whose final checkpoint was not committed: never a clean finish. torchrun
# restarts the group, which resumes from the newest committed checkpoint and saves again;
# with the restart budget spent the job ends Failed (docs/checkpoints.md, "Failed saves").
EXIT_FINAL_CHECKPOINT_FAILED = 3
# Exit code of a rank stopped by its own SIGTERM/SIGINT before training completed: non-zero,
# so its torchrun agent restarts the group (or, if the agent itself is being stopped, fails
# the pod, which the termination report marks as stopped, not failed). Exit 0 would make the
# agent treat the group as finished and wait out its exit barrier for peers that never come.
EXIT_STOPPED = 143  # 128 + SIGTERM, what an uncaught SIGTERM would have given
STOP_REASON_SIGNAL = "Signal"
PEER_SIGNAL_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class RunEnd:
    """The exit code, and whether the final checkpoint may still be writing (the process must
    then exit without closing the checkpointer, which would wait for it)."""

    code: int
    hard_exit: bool = False


def unrecovered_failure(checkpointer: Checkpointer) -> int:
    """The newest failed save not followed by a committed one (0: none)."""
    failed = checkpointer.last_failed_step
    return failed if failed > checkpointer.last_committed_step else 0


def finish_run(
    checkpointer: Checkpointer,
    stop_signal: StopSignal,
    *,
    step: int,
    stopped: bool,
    grace_seconds: float,
) -> RunEnd:
    """Wait for the final checkpoint (within the pod's grace period when stopped) and say
    how the run ends."""
    if not stopped:
        checkpointer.finish()
        if unrecovered_failure(checkpointer) >= step:
            log.error(
                "final checkpoint (step %d) failed; newest committed: step %d. Exiting "
                "with code %d so the run is restarted from it, not reported complete",
                step,
                checkpointer.last_committed_step,
                EXIT_FINAL_CHECKPOINT_FAILED,
            )
            return RunEnd(EXIT_FINAL_CHECKPOINT_FAILED)
        log.info("training complete at step %d", step)
        return RunEnd(0)
    if not stop_signal.requested:
        # A peer was signalled (its pod is going away); give our own signal a moment in
        # case the whole group is being stopped (torchrun scale-up restarts everyone).
        deadline = time.monotonic() + PEER_SIGNAL_WAIT_SECONDS
        while not stop_signal.requested and time.monotonic() < deadline:
            time.sleep(0.1)
    started = stop_signal.received_at or time.monotonic()
    left = max(0.0, grace_seconds - (time.monotonic() - started))
    hard_exit = not checkpointer.finish(timeout=left)
    if hard_exit:
        log.error("final checkpoint not committed within the %.0fs grace period", grace_seconds)
    log.info(
        "stopped at step %d (last committed checkpoint: step %d)",
        step,
        checkpointer.last_committed_step,
    )
    return RunEnd(EXIT_STOPPED if stop_signal.requested else EXIT_PEER_STOPPED, hard_exit)
