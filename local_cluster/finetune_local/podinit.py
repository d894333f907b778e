"""The first process of every local pod: enter private namespaces, mount, exec the command.

Run as ``python -I -S podinit.py <spec.json>`` (standard library only, no package import, so it
starts fast). In a fresh single-threaded process it is safe to call ``unshare(2)``, which a
``preexec_fn`` in the multi-threaded operator process would not be. Steps:

0. ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the pod dies with the local cluster's process (the
   kubelet thread that started it), however that process ends (``kill -9`` of ``ftjob run``
   included), as a real pod dies with its node. It survives ``execve``; the container's own
   children (torchrun's workers) watch for being orphaned themselves;
1. ``unshare(CLONE_NEWNS | CLONE_NEWUTS)``: a mount and a UTS namespace of its own;
2. make ``/`` a private mount tree, so the pod's mounts never propagate back to the host;
3. ``sethostname(<pod hostname>)``;
4. bind-mount each volume (and the pod's hosts file onto ``/etc/hosts``) at its mount path,
   read-only where asked; a volume over a directory that holds the pod's "image" (the Python
   environment, the project, the cluster's data dir: ``keepVisible``) would hide it, so those
   paths are bound again on top (a real pod has its own root filesystem; ours is the host's);
5. ``chdir`` to the working directory and ``execvp`` the container's command (PATH from the
   pod environment, which the kubelet already set).

Exit codes when setup fails (the kubelet reports them as the container's): 125 namespaces
or mounts could not be set up, 127 command not found, 126 command not executable.
"""

import ctypes
import ctypes.util
import json
import os
import socket
import sys

PR_SET_PDEATHSIG = 1
SIGKILL = 9
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, flags: int, shown: str | None = None) -> None:
    _check(
        _libc.mount(source.encode(), target.encode(), None, flags, None),
        f"mount {shown or source} on {target}",
    )


def die_with_parent(parent_pid: int) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent_pid and os.getppid() != parent_pid:  # the parent died before the prctl took hold
        os._exit(137)


def enter_namespaces(hostname: str) -> None:
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(CLONE_NEWNS|CLONE_NEWUTS)")
    _mount("none", "/", MS_REC | MS_PRIVATE)
    socket.sethostname(hostname)


def bind(source: str, target: str, read_only: bool, shown: str | None = None) -> None:
    _mount(source, target, MS_BIND | MS_REC, shown)
    if read_only:
        _mount(source, target, MS_BIND | MS_REMOUNT | MS_RDONLY, shown)


def _hidden_by(target: str, keep: list[str]) -> list[str]:
    prefix = target.rstrip("/") + "/"
    return [path for path in keep if path.startswith(prefix) and os.path.exists(path)]


def mount_volume(mount: dict[str, object], keep: list[str], source_fd: int | None = None) -> None:
    """Bind one volume; re-expose the kept paths it would shadow (held open with O_PATH across
    the mount, then bound back from /proc/self/fd). `source_fd`: the source, opened before any
    volume was mounted (see `main`)."""
    source, target = str(mount["source"]), str(mount["target"])
    held = {path: os.open(path, os.O_PATH) for path in _hidden_by(target, keep)}
    via = f"/proc/self/fd/{source_fd}" if source_fd is not None else source
    bind(via, target, bool(mount.get("readOnly", False)), shown=source)
    for path, fd in held.items():
        try:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            elif not os.path.exists(path):
                open(path, "a").close()
            _mount(f"/proc/self/fd/{fd}", path, MS_BIND | MS_REC)
        finally:
            os.close(fd)


def main() -> int:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    try:
        die_with_parent(int(spec.get("parentPid") or 0))
        enter_namespaces(spec["hostname"])
        # Every source as the host has it, held open before the first mount: a volume over a
        # directory (worker pods' emptyDir over /tmp) would otherwise hide a later volume's
        # source beneath it (a hostPath under /tmp: "mount /tmp/data on /data: No such file").
        sources = [os.open(str(mount["source"]), os.O_PATH) for mount in spec["mounts"]]
        for mount, fd in zip(spec["mounts"], sources, strict=True):
            mount_volume(mount, spec.get("keepVisible", []), fd)
            os.close(fd)
        os.chdir(spec["workingDir"])
    except OSError as exc:
        print(f"local kubelet: pod setup failed: {exc}", file=sys.stderr, flush=True)
        return 125
    if spec.get("probe"):
        return 0
    argv = spec["argv"]
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print(f"local kubelet: executable not found: {argv[0]!r}", file=sys.stderr, flush=True)
        return 127
    except PermissionError as exc:
        print(f"local kubelet: cannot execute {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 126
    return 0  # not reached: execvp replaces this process


if __name__ == "__main__":
    sys.exit(main())
