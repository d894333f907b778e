"""Pod addresses for one local cluster: a loopback /16 (`127.<net>.0.0/16`) claimed for the
cluster's lifetime, so two local clusters on one host never hand out the same pod address.

Pods of a local cluster share the host's network namespace and bind their own loopback
address (`$POD_IP`), as pods in separate network namespaces would bind their one interface.
The claim lives where the addresses live, in the network namespace: it is a bound
abstract-namespace Unix socket, `@finetune-local/net-<n>`. Abstract names belong to the
network namespace, not to a filesystem, so every cluster that can reach the same loopback
addresses sees the same claims, whatever its `$TMPDIR`, mount namespace (a container sharing
the host's network), user or file permissions; a lock file under a temp directory missed all
of these. The kernel frees the name when the socket closes, however its holder dies, so a
crashed cluster never leaks its network and no stale-claim rule is needed.
Within a cluster addresses are monotonic and never reused (a stale address cached by a peer
never reaches a new pod); 64,000 pods per cluster lifetime.
"""

from __future__ import annotations

import socket

FIRST_NET, LAST_NET = 1, 254  # 127.0.0.0/16 is left to the host (127.0.0.1: the API server)
PER_NET = 250 * 256
CLAIM_PREFIX = "finetune-local"


class AddressesExhaustedError(RuntimeError):
    """Every loopback /16 is held by another local cluster, or a cluster used all of its own."""


def claim_name(net: int, scope: str = "") -> str:
    """The abstract socket name that holds `127.<net>.0.0/16`. `scope` separates claims that
    must not meet real clusters' (tests of this module); clusters use the default."""
    return f"\0{CLAIM_PREFIX}{'/' + scope if scope else ''}/net-{net}"


def _bind(name: str) -> socket.socket | None:
    """The socket bound to `name`, or None when another process holds the name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inherited by pods (PEP 446)
    try:
        sock.bind(name)
    except OSError:  # EADDRINUSE: claimed by a live cluster
        sock.close()
        return None
    return sock


class AddressPool:
    """A claimed `127.<net>.0.0/16`. `allocate()` hands out 127.<net>.<hi>.<lo>, lo in 2..251."""

    def __init__(self, net: int, claim: socket.socket) -> None:
        self.net, self._claim, self._next = net, claim, 0

    @classmethod
    def claim(cls, scope: str = "") -> AddressPool:
        for net in range(FIRST_NET, LAST_NET + 1):
            held = _bind(claim_name(net, scope))
            if held is not None:
                return cls(net, held)
        raise AddressesExhaustedError(
            f"all loopback networks 127.{FIRST_NET}-{LAST_NET}.0.0/16 are held by other local "
            f"clusters on this host (`ss -xap | grep @{CLAIM_PREFIX}/` names their processes)"
        )

    def allocate(self) -> str:
        n = self._next
        if n >= PER_NET:
            raise AddressesExhaustedError(
                f"127.{self.net}.0.0/16: all {PER_NET} pod addresses used"
            )
        self._next += 1
        return f"127.{self.net}.{n // 250}.{n % 250 + 2}"

    def release(self) -> None:
        self._claim.close()  # closing frees the name (idempotent)
