"""Each local cluster claims its own loopback /16; a claim dies with its holder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from finetune_local.addresses import AddressPool


def test_two_clusters_get_disjoint_networks(tmp_path: Path) -> None:
    a, b = AddressPool.claim(tmp_path), AddressPool.claim(tmp_path)
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


def test_released_or_killed_holder_frees_the_network(tmp_path: Path) -> None:
    first = AddressPool.claim(tmp_path)
    net = first.net
    first.release()
    assert AddressPool.claim(tmp_path).net == net  # (held until the test process exits)
    code = (
        "import sys, os, signal; from pathlib import Path;"
        "from finetune_local.addresses import AddressPool;"
        f"p = AddressPool.claim(Path({str(tmp_path)!r})); print(p.net, flush=True);"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    held_by_dead = int(out.stdout.split()[0])
    assert held_by_dead != net
    again = AddressPool.claim(tmp_path)
    assert again.net == held_by_dead  # the SIGKILLed holder's lock went with it
