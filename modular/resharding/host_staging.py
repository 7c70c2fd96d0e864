"""Off CPU, the old shards of the kernels a reshard rebuilds pass through host memory, so that a
rank's device never holds them beside their kernels' new buffers (Note [reshard memory] in
memory.py, "On a device")."""

from __future__ import annotations

import gc
from typing import Optional

import torch

from modular.resharding.memory import sole_holders
from modular.resharding.moves import ModuleMove, Shards

__all__ = ["Staged", "stages"]

# Whether old shards of rebuilt kernels pass through host memory. Off (False) until a GPU session
# has run the path: it frees device storages in place, and docs/resharding.md ("Memory") lists
# what must be checked first; then None, "every device but CPU". Tests set True on CPU ranks.
_STAGE_THROUGH_HOST: Optional[bool] = False


def stages(device: torch.device) -> bool:
    return device.type != "cpu" if _STAGE_THROUGH_HOST is None else _STAGE_THROUGH_HOST


class Staged:
    """The storages of the old kernels that no new module can adopt (`Adoption`'s candidates are
    left where they are), each copied to host and then freed in place (`resize_(0)`: every
    tensor on it, the old module's views and fbgemm's own, stays the same object), and readers
    over the host copies. `restore` gives them back their bytes, where the reshard failed or
    something besides the mover still holds them once the old modules are dropped."""

    def __init__(self, moves: list[ModuleMove], candidates: list[frozenset]) -> None:
        self._storages: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {}  # key -> (device tensor, host)
        self.readers: list[Shards] = []
        for move, stay in zip(moves, candidates):
            reader = move.reader()
            staying = {_key(t) for key, t in _tensors(reader) if key in stay}
            views = {k: self._host(v, staying) for k, v in reader.views.items()}
            states = {k: {n: self._host(s, staying) for n, s in st.items()} for k, st in reader.states.items()}
            self.readers.append(Shards(reader.layout, views, states))
        for device_tensor, _ in self._storages.values():
            device_tensor.untyped_storage().resize_(0)

    def _host(self, tensor: torch.Tensor, staying: set) -> torch.Tensor:
        key = _key(tensor)
        if key in staying or tensor.numel() == 0 or not tensor.untyped_storage().resizable():
            return tensor
        if key not in self._storages:
            storage = tensor.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            host = torch.UntypedStorage(storage.nbytes())  # a copy, also from a CPU storage
            host.copy_(storage)
            self._storages[key] = (whole, host)
        host = self._storages[key][1]
        t = tensor.detach()
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.shape, t.stride())

    def is_host(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(host.data_ptr() == ptr for _, host in self._storages.values())

    def restore(self, only_held: bool = False, collect: bool = False) -> set[int]:
        """Gives the freed storages their bytes back from host: all of them, or `only_held`
        those something besides the mover holds (Note [reshard memory]); returns the host
        copies' data pointers of those restored."""
        keys = list(self._storages)
        if only_held:
            keys = [k for k in keys if not sole_holders(self._storages[k][0])]
            if keys and collect:
                gc.collect()
                keys = [k for k in keys if not sole_holders(self._storages[k][0])]
        restored = set()
        for k in keys:
            whole, host = self._storages[k]
            whole.untyped_storage().resize_(host.nbytes())
            whole.untyped_storage().copy_(host)
            restored.add(host.data_ptr())
        return restored


def _tensors(reader: Shards) -> list:
    out = [(key, v) for key, v in reader.views.items()]
    out += [(key, s) for key, st in reader.states.items() for s in st.values()]
    return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
