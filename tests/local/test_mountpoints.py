"""Mount targets shared by local clusters on one host: the last user removes them.

Removing a directory that is a mount point in another mount namespace detaches that mount
there, so one cluster stopping must not remove a target another cluster's pods have mounted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from finetune_local.mountpoints import MountPoints


def test_a_target_two_clusters_use_outlives_the_first_to_stop(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    target = tmp_path / "host" / "etc" / "finetune"
    first, second = MountPoints(registry), MountPoints(registry)
    first.ensure(target, is_file=False)  # creates host/, etc/, finetune/
    second.ensure(target, is_file=False)  # finds them: uses them, creates nothing
    first.remove_created()
    assert target.is_dir()  # the second cluster's pods still have it mounted
    second.remove_created()
    assert not (tmp_path / "host").exists()  # the last user removed all the first made


def test_a_target_the_host_had_is_never_removed(tmp_path: Path) -> None:
    target = tmp_path / "checkpoints"
    target.mkdir()
    points = MountPoints(tmp_path / "registry")
    points.ensure(target / "job.json", is_file=True)
    points.remove_created()
    assert target.is_dir()
    assert not (target / "job.json").exists()


def test_a_dead_clusters_registration_does_not_keep_a_target(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    target = tmp_path / "etc-finetune"
    # A cluster in a process that has since died (killed without its teardown).
    code = (
        "import pathlib, sys; from finetune_local.mountpoints import MountPoints; "
        "MountPoints(pathlib.Path(sys.argv[1])).ensure(pathlib.Path(sys.argv[2]), is_file=False)"
    )
    subprocess.run([sys.executable, "-c", code, str(registry), str(target)], check=True)
    assert target.is_dir()
    live = MountPoints(registry)
    live.ensure(target, is_file=False)
    live.remove_created()
    assert not target.exists()


def test_a_registration_whose_pid_was_reused_does_not_keep_a_target(tmp_path: Path) -> None:
    """A cluster killed without its teardown leaves its token; when the kernel gives its PID to
    another process (here: ours), the token's start time tells them apart."""
    registry = tmp_path / "registry"
    target = tmp_path / "etc-finetune"
    live = MountPoints(registry)
    live.ensure(target, is_file=False)
    pid, started, _ = live.token.split("-")
    assert started != "0"  # /proc/<pid>/stat is readable here
    entry = next(p for p in registry.iterdir() if not p.name.startswith("."))
    (entry / f"{pid}-{int(started) - 1}-1").touch()  # same PID, started before ours: dead
    live.remove_created()
    assert not target.exists()


def test_a_live_registration_with_an_unknown_start_time_keeps_a_target(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    target = tmp_path / "etc-finetune"
    first = MountPoints(registry)
    first.ensure(target, is_file=False)
    entry = next(p for p in registry.iterdir() if not p.name.startswith("."))
    pid = first.token.split("-")[0]
    for token in (f"{pid}-77", f"{pid}-0-78"):  # an older token format; /proc unreadable
        (entry / token).touch()
    first.remove_created()
    assert target.is_dir()  # our PID is alive: those registrants may be


def test_mount_points_in_use_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    """/proc/<pid>/mountinfo's fifth field: octal escapes for a space or a backslash, a UTF-8
    name as it is (read as Latin-1 it matched no target, which could then be removed)."""
    from finetune_local.mountpoints import mount_points_in_use

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "mountinfo").write_text(
        "36 35 98:0 / /data/données rw - ext4 /dev/sda1 rw\n"
        "37 35 98:0 / /mnt/a\\040b\\134c rw - ext4 /dev/sda1 rw\n",
        encoding="utf-8",
    )
    assert mount_points_in_use(tmp_path) == {"/data/données", "/mnt/a b\\c"}
