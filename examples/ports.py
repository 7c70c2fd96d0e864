"""`free_port`: a free TCP port on this host, for the MASTER_PORT of ranks started on it.

The examples launch their own CPU ranks (`python examples/train_dlrm.py --world-size 2`), and so
do scripts/ and the tests that start processes outside tests/dist.py. Those ranks are separate
programs that meet at env://'s MASTER_PORT (as under torchrun), so the port has to be picked
before they start. Where the launcher is the ranks' Python parent and can hold their store for
them, nothing needs picking: tests/dist.py and the benchmarks do that (Note [ranks meet at a
store their parent holds] in benchmarks/_rendezvous.py). The one helper lives here, in the
examples, because the examples must run on their own (they import nothing from tests/ or
benchmarks/), while tests and benchmarks may import the examples: so every launcher can share it
without a benchmark or an example importing a test module.

# Note [a master port nobody else is handed]
A launcher picks MASTER_PORT, closes its probe socket, and rank 0 binds the port seconds later
(after importing torch). Asking the kernel for port 0 would pick from the ephemeral range, which
every other bind(0) and every outgoing connect() on the host draws from too: gloo binds a
listener on port 0 for each process group and connects each pair of ranks, so on a host running
other distributed jobs one of them may be handed the same port in that window, and rank 0 fails
with EADDRINUSE. So the port comes from outside the ephemeral range (Linux:
/proc/sys/net/ipv4/ip_local_port_range), where the kernel never hands out ports by itself; only
another launcher choosing at random from the same ~20k ports could collide. The pick uses
SystemRandom: processes forked from one parent share `random`'s state and would pick alike.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000  # below it sit many fixed service ports
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = (int(p) for p in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the kernel's ephemeral range where it has one
    (Note [a master port nobody else is handed]). The socket is closed before the ranks bind it;
    launchers start their ranks at once to keep that window small."""
    ephemeral = _ephemeral_range()
    if ephemeral is not None:
        low, high = ephemeral
        outside = [r for r in (range(_LOWEST, low), range(high + 1, 65_536)) if len(r) > 0]
        pick = random.SystemRandom()
        for _ in range(_TRIES if outside else 0):
            port = pick.choice(pick.choices(outside, weights=[len(r) for r in outside])[0])
            if _bindable(port):
                return port
    with socket.socket() as s:  # no such range, or nothing free in it: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
