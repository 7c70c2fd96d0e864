"""`free_port`: a free TCP port on this host, for the MASTER_PORT of ranks started on it.

The examples launch their own CPU ranks (`python examples/train_dlrm.py --world-size 2`), and so
do the benchmarks and the tests that spawn processes outside tests/dist.py. The one helper lives
here, in the examples, because the examples must run on their own (they import nothing from
tests/ or benchmarks/), while tests and benchmarks may import the examples: so every launcher can
share it without a benchmark or an example importing a test module.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now. The socket is closed before the ranks bind it, so another
    process could take it in between; launchers start their ranks at once to keep that window small."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
