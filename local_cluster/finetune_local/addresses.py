"""Pod addresses for one local cluster: a loopback /16 (`127.<net>.0.0/16`) claimed for the
cluster's lifetime, so two local clusters on one host never hand out the same pod address.

Pods of a local cluster share the host's network namespace and bind their own loopback
address (`$POD_IP`), as pods in separate network namespaces would bind their one interface.
The claim is an exclusive `flock` on `<lock_dir>/net-<n>.lock`: the kernel drops it when the
process holding it dies, however it dies, so a crashed cluster never leaks its network.
Within a cluster addresses are monotonic and never reused (a stale address cached by a peer
never reaches a new pod); 64,000 pods per cluster lifetime.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile

FIRST_NET, LAST_NET = 1, 254  # 127.0.0.0/16 is left to the host (127.0.0.1: the API server)
PER_NET = 250 * 256


class AddressesExhaustedError(RuntimeError):
    """Every loopback /16 is held by another local cluster, or a cluster used all of its own."""


def default_lock_dir() -> pathlib.Path:
    return pathlib.Path(tempfile.gettempdir()) / "ftjob-local-nets"


class AddressPool:
    """A claimed `127.<net>.0.0/16`. `allocate()` hands out 127.<net>.<hi>.<lo>, lo in 2..251."""

    def __init__(self, net: int, fd: int) -> None:
        self.net, self._fd, self._next = net, fd, 0

    @classmethod
    def claim(cls, lock_dir: pathlib.Path | None = None) -> AddressPool:
        directory = lock_dir or default_lock_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            directory.chmod(0o1777)  # shared by every user's clusters, like /tmp
        for net in range(FIRST_NET, LAST_NET + 1):
            fd = os.open(directory / f"net-{net}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return cls(net, fd)
        raise AddressesExhaustedError(
            f"all loopback networks 127.{FIRST_NET}-{LAST_NET}.0.0/16 are held by other local "
            f"clusters (locks in {directory})"
        )

    def allocate(self) -> str:
        n = self._next
        if n >= PER_NET:
            raise AddressesExhaustedError(f"127.{self.net}.0.0/16: all {PER_NET} pod addresses used")
        self._next += 1
        return f"127.{self.net}.{n // 250}.{n % 250 + 2}"

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1
