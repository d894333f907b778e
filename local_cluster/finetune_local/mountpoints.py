"""Mount targets the host lacks (`/etc/finetune`, `/checkpoints`...): created for the pods' bind
mounts and removed when no local cluster on the host uses them any more.

Why a host-wide count and not each cluster removing what it created: removing a directory that
is a mount point in another mount namespace detaches that mount there (Linux 3.18 and later).
Two local clusters on one host (a test run beside `ftjob run --local`, the quick and the slow
halves of `make test`) share the host's `/etc/finetune`; the first to stop would pull it out
from under the other's running pods, whose next trainer start (torchrun restarting a worker
group) finds no `job.json`. So each user of a target that a local cluster created registers
itself under `REGISTRY`, and the last one leaving removes the target. Registrations of dead
processes (a cluster killed without its teardown) are dropped by the next one leaving. A
target some process's mount namespace still has a mount on (/proc/*/mountinfo) is never
removed either, registered or not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator
from urllib.parse import quote

REGISTRY = pathlib.Path(tempfile.gettempdir()) / "finetune-local-mountpoints"
CREATED = "created"  # marker: a local cluster made this path, so the last user removes it


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22), which
    tells a reused PID from the process that registered; '' where /proc cannot say."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _registrant_alive(token: str) -> bool:
    """Whether the cluster that wrote `token` ("<pid>-<start time>-<id>") may still run: its
    PID is alive and, where /proc says, started when the token was written. A PID the kernel
    has given to a new process since (a cluster killed without its teardown, then a long run of
    other processes) would otherwise keep its targets on the host forever."""
    pid, _, rest = token.partition("-")
    if not pid.isdigit() or int(pid) <= 0:
        return False  # os.kill(0) would signal our own process group: no registrant's token
    # "<pid>-<id>" (written before start times were) or "<pid>-0-<id>" (/proc unreadable then):
    # the PID alone says.
    started = rest.split("-", 1)[0] if "-" in rest else "0"
    if not _alive(int(pid)):
        return False
    now = _start_time(int(pid)) if started != "0" else ""
    return not now or now == started


class MountPoints:
    """One local cluster's use of the host's mount targets."""

    def __init__(self, registry: pathlib.Path = REGISTRY) -> None:
        self.registry = registry
        # One token per cluster (several may run in one process): "<pid>-<start time>-<id>".
        pid = os.getpid()
        self.token = f"{pid}-{_start_time(pid) or 0}-{id(self)}"
        self.used: list[pathlib.Path] = []  # deepest last, in the order registered

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.registry.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.registry / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _entry(self, path: pathlib.Path) -> pathlib.Path:
        return self.registry / quote(str(path), safe="")

    def ensure(self, target: pathlib.Path, is_file: bool) -> None:
        """Create `target` (and its missing parents) if the host lacks it, and register this
        cluster as a user of every one of them that a local cluster created."""
        with self._locked():
            chain = [target, *target.parents]
            for path in reversed([p for p in chain if not p.exists()]):
                if path == target and is_file:
                    path.touch()
                else:
                    path.mkdir()
                entry = self._entry(path)
                entry.mkdir(exist_ok=True)
                (entry / CREATED).touch()
            for path in reversed(chain):  # parents first: removed after their children
                entry = self._entry(path)
                if (entry / CREATED).exists() and path not in self.used:
                    (entry / self.token).touch()
                    self.used.append(path)

    def remove_created(self) -> None:
        """Leave every target this cluster used; remove those no live cluster uses any more."""
        in_use = mount_points_in_use()
        with self._locked():
            for path in reversed(self.used):
                entry = self._entry(path)
                with contextlib.suppress(FileNotFoundError):
                    (entry / self.token).unlink()
                users = [u for u in _listdir(entry) if u != CREATED]
                for user in users:
                    if not _registrant_alive(user):
                        with contextlib.suppress(FileNotFoundError):
                            (entry / user).unlink()
                if any(u != CREATED for u in _listdir(entry)):
                    continue  # another cluster's pods may have it mounted
                if str(path) in in_use:  # mounted on by a process no cluster registered
                    continue
                with contextlib.suppress(OSError):  # something else now lives there: leave it
                    path.unlink() if path.is_file() else path.rmdir()
                with contextlib.suppress(OSError):
                    (entry / CREATED).unlink()
                    entry.rmdir()
            self.used.clear()


# The kernel escapes a space, tab, newline and backslash in a mount point as \ooo; every other
# byte (a UTF-8 name's too) is as it is. ("unicode_escape" read such a name as Latin-1.)
_OCTAL = re.compile(r"\\([0-7]{3})")


def mount_points_in_use(proc: pathlib.Path = pathlib.Path("/proc")) -> set[str]:
    """Every mount point of every process's mount namespace (as /proc/<pid>/mountinfo has it:
    its fifth field, octal escapes decoded)."""
    points: set[str] = set()
    for info in proc.glob("[0-9]*/mountinfo"):
        try:
            # As os.fsdecode names paths: a name that is no UTF-8 still compares equal.
            lines = info.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in lines:
            fields = line.split(" ")
            if len(fields) > 4:
                points.add(_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def _listdir(entry: pathlib.Path) -> list[str]:
    try:
        return os.listdir(entry)
    except FileNotFoundError:
        return []
