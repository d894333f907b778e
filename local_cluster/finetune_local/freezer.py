"""Freezing a lost node's pod processes, and the keeper that never lets them outlive the cluster.

A network partition leaves a pod's processes running but silent to everyone else: its peers'
connections stay open and no byte arrives (the survivors only fail when a collective times
out). Locally, where every pod shares the host's loopback, the nearest equivalent is to stop
the processes (SIGSTOP): their sockets stay open and nothing they would send is sent.

Stopped processes cannot notice anything themselves: the trainers' orphan watchdog (a thread)
is stopped with them, and the pods' parent-death signal (:mod:`.podinit`) reaches only the
container's first process. So while a node is frozen a small keeper process holds its pids:
it is told by its own parent-death signal when the thread that runs the cluster dies (however
it dies: ``kill -9`` of ``ftjob run`` included) and SIGKILLs them (a stopped process dies of
SIGKILL). The kubelet stops the keeper before it thaws or kills the pids itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

from finetune_local.podrunner import pod_processes, signal_group

# The keeper, run as `python -I -S -c KEEPER <parent pid> <pid>...`: standard library only.
_KEEPER = """
import ctypes, ctypes.util, os, signal, sys
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
def reap(*_):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
signal.signal(signal.SIGUSR1, reap)
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.prctl(1, int(signal.SIGUSR1), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    reap()
sys.stdout.write("ready\\n")
sys.stdout.flush()
while True:
    signal.pause()
"""
_ROUNDS = 5  # a process may fork while its tree is being stopped: look again until none is new


def freeze(pid: int) -> list[int]:
    """SIGSTOP the pod whose first process is `pid`: its process group, then every process of
    its tree (torchrun's workers run in sessions of their own). The pids stopped."""
    signal_group(pid, signal.SIGSTOP)
    stopped: list[int] = []
    for _ in range(_ROUNDS):
        new = [p for p in pod_processes(pid) if p not in stopped]
        if not new:
            break
        for target in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGSTOP)
        stopped.extend(new)
    return stopped


def thaw(pids: list[int]) -> None:
    """SIGCONT what `freeze` stopped (the ones still alive)."""
    for target in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGCONT)


async def start_keeper(pids: list[int]) -> asyncio.subprocess.Process:
    """The keeper of these stopped pids (see the module docstring); ready when returned."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", _KEEPER, str(os.getpid()), *map(str, pids),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        start_new_session=True,  # a signal to the cluster's process group is not for it
    )  # fmt: skip
    assert proc.stdout is not None
    await asyncio.wait_for(proc.stdout.readline(), 30)
    return proc


async def stop_keeper(proc: asyncio.subprocess.Process) -> None:
    """Dismiss the keeper without it killing anything (SIGTERM: its default action)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), 10)
