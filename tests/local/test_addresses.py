"""Each local cluster claims its own loopback /16; a claim dies with its holder, and every
cluster on the host sees it, whatever its temp directory."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from finetune_local.addresses import AddressPool


@pytest.fixture
def scope() -> str:
    """Claims of this test only: real local clusters running beside it are not disturbed."""
    return f"test-{uuid.uuid4().hex[:12]}"


def _holder(scope: str, tmpdir: Path) -> subprocess.Popen[str]:
    """Another process (another `ftjob run --local`) claiming a network and holding it until its
    stdin closes, with a temp directory of its own."""
    code = (
        "import sys; from finetune_local.addresses import AddressPool;"
        f"p = AddressPool.claim({scope!r}); print(p.net, p.allocate(), flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip


def test_two_clusters_get_disjoint_networks(scope: str) -> None:
    a, b = AddressPool.claim(scope), AddressPool.claim(scope)
    try:
        assert a.net != b.net
        ips_a = {a.allocate() for _ in range(600)}
        ips_b = {b.allocate() for _ in range(600)}
        assert len(ips_a) == 600 and not ips_a & ips_b
        assert all(ip.startswith(f"127.{a.net}.") for ip in ips_a)
        assert "127.0.0.1" not in ips_a | ips_b
        last_octets = {int(ip.rsplit(".", 1)[1]) for ip in ips_a}
        assert min(last_octets) >= 2 and max(last_octets) <= 251
    finally:
        a.release()
        b.release()


def test_concurrent_sessions_with_their_own_temp_dirs_get_disjoint_networks(
    scope: str, tmp_path: Path
) -> None:
    """Two sessions at once, each with its own $TMPDIR (two CI jobs, two containers sharing the
    host's network): a claim made under one temp directory must still be seen by the other."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = _holder(scope, tmp_path / "a"), _holder(scope, tmp_path / "b")
    try:
        assert first.stdout is not None and second.stdout is not None
        net_a, ip_a = first.stdout.readline().split()
        net_b, ip_b = second.stdout.readline().split()
        assert net_a != net_b and ip_a != ip_b
        mine = AddressPool.claim(scope)  # a third, in this process's own temp directory
        assert str(mine.net) not in (net_a, net_b)
        mine.release()
    finally:
        for proc in (first, second):
            proc.communicate(timeout=60)  # closes stdin: the holder exits


def test_released_or_killed_holder_frees_the_network(scope: str) -> None:
    first = AddressPool.claim(scope)
    net = first.net
    first.release()
    first.release()  # idempotent
    again = AddressPool.claim(scope)
    assert again.net == net
    code = (
        "import os, signal; from finetune_local.addresses import AddressPool;"
        f"p = AddressPool.claim({scope!r}); print(p.net, flush=True);"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    held_by_dead = int(out.stdout.split()[0])
    assert held_by_dead != net
    after = AddressPool.claim(scope)
    assert after.net == held_by_dead  # the SIGKILLed holder's claim went with it
    after.release()
    again.release()
