"""Finding the processes of a local cluster (every pod process carries FTJOB_LOCAL_CLUSTER)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from finetune_local.imageenv import CLUSTER_ENV


def cluster_processes(data_dir: Path) -> list[int]:
    """PIDs of live processes started for the local cluster whose data dir is `data_dir`."""
    marker = f"{CLUSTER_ENV}={data_dir.resolve()}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie is dead, only not yet reaped by its parent
                    found.append(int(proc.name))
    return found
