"""Where a benchmark's spawned ranks meet: a TCPStore that the parent holds for them.

    with hosted_rendezvous() as rendezvous:
        mp.spawn(_worker, args=(cfg, rendezvous), nprocs=world_size, join=True)

    def _worker(rank, cfg, rendezvous):
        dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=...)

# Note [ranks meet at a store their parent holds]
Ranks handed MASTER_PORT=`examples.ports.free_port()` meet at a port that the parent probed and
closed, and that rank 0 binds seconds later, after importing torch. A process that binds it in
that window makes rank 0 fail with EADDRINUSE; Note [a master port nobody else is handed] in
examples/ports.py makes that rare, not impossible. Here the parent hosts the ranks' TCPStore
itself, on a port the kernel hands it, bound before any rank starts and held until they are done,
and every rank connects to it as a client, as tests/dist.py's pools do: there is no window. A
store serves one spawn: a second world on the same store would read the first one's keys, so
each spawn opens its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """The port of the store `hosted_rendezvous` holds; picklable, so it can be a rank's arg."""

    port: int

    def store(self) -> dist.Store:
        """A client of the parent's store, for `init_process_group(store=...)`; call it in a rank.

        It waits for a slow peer as long as env:// rendezvous would (torch's default process group
        timeout)."""
        return dist.TCPStore(_HOST, self.port, is_master=False, timeout=default_pg_timeout)


@contextlib.contextmanager
def hosted_rendezvous() -> Iterator[Rendezvous]:
    """Hosts one spawn's store in this process while the block runs (Note [ranks meet at a store
    their parent holds]); start and join the ranks inside it."""
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)
    try:
        yield Rendezvous(store.port)
    finally:
        del store
