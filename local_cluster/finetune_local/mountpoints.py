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
import tempfile
from collections.abc import Iterator
from urllib.parse import quote

REGISTRY = pathlib.Path(tempfile.gettempdir()) / "finetune-local-mountpoints"
CREATED = "created"  # marker: a local cluster made this path, so the last user removes it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MountPoints:
    """One local cluster's use of the host's mount targets."""

    def __init__(self, registry: pathlib.Path = REGISTRY) -> None:
        self.registry = registry
        # One token per cluster (several may run in one process): "<pid>-<id>".
        self.token = f"{os.getpid()}-{id(self)}"
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
                    pid = int(user.split("-", 1)[0]) if user.split("-", 1)[0].isdigit() else 0
                    if not _alive(pid):
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


def mount_points_in_use(proc: pathlib.Path = pathlib.Path("/proc")) -> set[str]:
    """Every mount point of every process's mount namespace (as /proc/<pid>/mountinfo has it:
    its fifth field, octal escapes decoded)."""
    points: set[str] = set()
    for info in proc.glob("[0-9]*/mountinfo"):
        try:
            lines = info.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in lines:
            fields = line.split(" ")
            if len(fields) > 4:
                points.add(fields[4].encode().decode("unicode_escape"))
    return points


def _listdir(entry: pathlib.Path) -> list[str]:
    try:
        return os.listdir(entry)
    except FileNotFoundError:
        return []
