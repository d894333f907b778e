"""Entry point: `python -m finetune_trainer --config job.json`, one process per rank under
torchrun. Parse, build, train, and always tear the process group down."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from finetune_operator.api.constants import CONFIG_PATH
from finetune_trainer.config import RuntimeEnv, load_job_config
from finetune_trainer.crash import record_exception, record_peer_stop, recorded
from finetune_trainer.distributed import describe_failure, destroy_distributed, exit_process
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.refusal import EXIT_CONFIG_ERROR, refuse
from finetune_trainer.termination_log import write_error_report

EXIT_ORPHANED = 137


def exit_when_orphaned(interval: float = 1.0) -> None:
    """torchrun starts each worker in its own session, so a SIGKILLed agent (a pod killed
    without a cgroup teardown, a crashed agent) would leave the worker training on alone.
    Die with the agent instead: poll for being re-parented."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


@recorded  # torchelastic's error file: what torchrun's ChildFailedError carries to launch.py
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune_trainer", description=__doc__)
    parser.add_argument("--config", default=CONFIG_PATH, help="job.json written by the operator")
    args = parser.parse_args(argv)
    env = RuntimeEnv.from_environ()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_when_orphaned()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s rank{env.rank} %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("finetune_trainer")
    from finetune_trainer.trainer import Trainer  # torch import after logging is set up

    trainer = None
    code, failed = 1, False
    try:
        trainer = Trainer(load_job_config(args.config), env)
        code = trainer.train()
        from finetune_trainer.finish import EXIT_PEER_STOPPED

        if code == EXIT_PEER_STOPPED:
            record_peer_stop()
    except UnsupportedConfigError as e:
        log.error("unsupported job configuration: %s", e)
        write_error_report(str(e), rank=env.rank)
        # Not worth a restart: every attempt would refuse the same way (refusal.py).
        refuse(str(e))
        code = EXIT_CONFIG_ERROR
    except Exception as e:
        # A bug, a bad data row, an OOM, or a peer vanished mid-collective: torchrun restarts
        # the group. Background save threads may be stuck on the same peer, so do not wait for
        # them on the way out; os._exit skips `record`, so write the error file here.
        log.exception("training failed")
        described = describe_failure(e, trainer.timeout.current if trainer else None)
        if described is not e:
            log.error("%s", described)
        record_exception(described)
        code, failed = 1, True
    finally:
        hard = failed or (trainer is not None and trainer.hard_exit)
        if trainer is not None and not hard:
            try:
                trainer.close()
            except Exception as e:
                # Still tear the group down and leave through exit_process: escaping here,
                # the error would skip both and the process would abort in finalisation.
                log.exception("closing the trainer failed")
                record_exception(e)
                code = 1
        destroy_distributed()
    if hard:
        # A save thread may still be blocked on a vanished peer: do not wait for it.
        exit_process(code)
    return code


if __name__ == "__main__":
    # Not sys.exit: a clean finish would still abort in interpreter finalisation
    # (distributed.exit_process says why).
    exit_process(main())
