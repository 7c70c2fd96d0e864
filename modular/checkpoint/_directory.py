"""The checkpoint directory: atomic commit, the manifest, and reading DCP files without pickle code.

# Note [checkpoint layout]
`save(path, ...)` never writes into `path`. Every rank writes its DCP files into a fresh sibling
`<path>.tmp-<token>/` (DCP's `__<rank>_<n>.distcp` data files and rank 0's `.metadata`); when every
rank has finished, each hashes the files it wrote, rank 0 writes `checkpoint.json` (sha256 and
size of every file, `.metadata` included) and then swaps the directories:

    rename <path>            -> <path>.prev-<token>     (only if a previous checkpoint exists)
    rename <path>.tmp-<token> -> <path>
    remove <path>.prev-<token>

`<path>` may be absent, an empty directory or a checkpoint (it has `checkpoint.json`): the swap
replaces `<path>` whole, so rank 0 refuses anything else before a byte is written
(`refuse_save_target`), and every rank raises. A checkpoint root holding `step_*` checkpoints and
the user's own files, or a file, is never swapped out and deleted.

A rank killed before the swap leaves `<path>` untouched (the half-written `.tmp-*` is removed by
the next successful save). A crash between the two renames leaves no `<path>` but a complete
`<path>.prev-<token>`, which `load` finds and uses. `checkpoint.json` is what makes a directory a
checkpoint: it is written last, after every data file is on disk (DCP fsyncs each file).

Loading trusts nothing in the directory until it is checked: `checkpoint.json` is JSON, every
file's size and sha256 are verified (each rank hashes a share of the files) before a byte of it is
deserialised, and the two places where DCP unpickles are replaced: `.metadata` is read with an
unpickler that only builds DCP's own metadata classes, and non-tensor items (optimizer
hyperparameters) are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from modular.errors import CheckpointError

MANIFEST = "checkpoint.json"
FORMAT = "modular.checkpoint/1"
METADATA_FILE = ".metadata"
_CHUNK = 1 << 22


def agree(error: Optional[str], group: Optional[dist.ProcessGroup] = None) -> None:
    """Raises on every rank if any rank has an error, so that no rank walks into a collective alone."""
    error = any_rank_error(error, group)
    if error is not None:
        raise CheckpointError(error)


def any_rank_error(
    error: Optional[str], group: Optional[dist.ProcessGroup] = None
) -> Optional[str]:
    """This rank's error, else the first other rank's (saying which), else None; the same verdict
    on every rank (one all-gather)."""
    errors: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if error is not None:
        return error
    for rank, e in enumerate(errors):
        if e is not None:
            return f"rank {rank} failed, so every rank stops: {e}"
    return None


def new_token(group: Optional[dist.ProcessGroup] = None) -> str:
    """A name for this save that every rank agrees on (rank 0 draws it)."""
    box = [uuid.uuid4().hex[:12] if dist.get_rank(group) == 0 else ""]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def tmp_dir(path: Path, token: str) -> Path:
    return path.with_name(f"{path.name}.tmp-{token}")


def sha256_of(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def refuse_save_target(path: Path) -> Optional[str]:
    """Why `save` must not replace `path`, or None (Note [checkpoint layout])."""
    if not path.exists() or (path / MANIFEST).is_file():
        return None
    if not path.is_dir():
        return (
            f"cannot save a checkpoint to {str(path)!r}: it is a file, and saving would replace "
            "it; choose a new directory path (nothing was written)"
        )
    if any(path.iterdir()):
        return (
            f"cannot save a checkpoint to {str(path)!r}: it exists and is not a modular "
            f"checkpoint (it has no {MANIFEST}), and saving would replace it with everything it "
            f"holds; save to a new path inside it, e.g. {str(path / 'step_1000')!r}, or remove it "
            "first (nothing was written)"
        )
    return None  # an empty directory: nothing is lost


def hash_rank_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The digests of the data files DCP's FileSystemWriter wrote for `rank` (`__<rank>_*`)."""
    return {p.name: sha256_of(p) for p in sorted(directory.glob(f"__{rank}_*"))}


def commit(path: Path, tmp: Path, files: dict[str, dict[str, Any]], world_size: int) -> None:
    """Rank 0: writes the manifest into `tmp` and swaps it in for `path` (Note [checkpoint layout])."""
    files = dict(files)
    files[METADATA_FILE] = sha256_of(tmp / METADATA_FILE)
    manifest = {"format": FORMAT, "world_size": world_size, "files": dict(sorted(files.items()))}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    prev = path.with_name(f"{path.name}.prev-{tmp.name.rpartition('-')[2]}")
    if path.exists():
        os.rename(path, prev)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if prev.exists():
        shutil.rmtree(prev)
    for stale in path.parent.glob(f"{path.name}.tmp-*"):  # left by interrupted saves
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: Path) -> Path:
    """`path`, or the complete previous checkpoint a crash mid-swap left beside it."""
    if path.is_dir():
        return path
    prev = sorted(path.parent.glob(f"{path.name}.prev-*"))
    prev = [p for p in prev if (p / MANIFEST).is_file()]
    if not path.exists() and len(prev) == 1:
        return prev[0]
    partial = sorted(p.name for p in path.parent.glob(f"{path.name}.tmp-*"))
    hint = f"; {partial} are saves that did not finish" if partial else ""
    raise CheckpointError(f"no checkpoint at {str(path)!r}{hint}")


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete modular checkpoint: it has no {MANIFEST}, which "
            "modular.checkpoint.save writes last (Note [checkpoint layout])"
        )
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{str(file)!r} is damaged (not JSON: {e}); the checkpoint cannot be verified, so "
            "nothing was loaded"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{str(file)!r} has format {found!r}; this version reads {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and {"bytes", "sha256"} <= set(v) for v in files.values()
    ):
        raise CheckpointError(
            f"{str(file)!r} is damaged: it has no valid 'files' list of sizes and sha256 sums, so "
            "the checkpoint cannot be verified and nothing was loaded"
        )
    return manifest


def verify_file(path: Path, name: str, expected: dict[str, Any]) -> Optional[str]:
    """None if the file is intact, else why not (naming the file)."""
    file = path / name
    if not file.is_file():
        return f"checkpoint file {str(file)!r} is missing"
    got = sha256_of(file)
    if got["bytes"] != expected["bytes"]:
        return (
            f"checkpoint file {str(file)!r} has {got['bytes']} bytes but {MANIFEST} records "
            f"{expected['bytes']}; the file is truncated or was overwritten"
        )
    if got["sha256"] != expected["sha256"]:
        return (
            f"checkpoint file {str(file)!r} is corrupted: its sha256 is {got['sha256'][:16]}... "
            f"but {MANIFEST} records {expected['sha256'][:16]}..."
        )
    return None


# Every global a DCP `.metadata` pickle may name; anything else is refused, so loading a
# checkpoint never runs code chosen by whoever wrote the file.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}
_DTYPES = {str(d).split(".")[1] for d in vars(torch).values() if isinstance(d, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's {METADATA_FILE} names {module}.{name}, which is not DCP metadata; "
            "refusing to unpickle it"
        )


def read_metadata(path: Path) -> Metadata:
    file = path / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # unpickling bytes can raise almost anything; each means "not metadata"
        raise CheckpointError(
            f"{str(file)!r} cannot be read as DCP metadata ({type(e).__name__}: {e}); nothing "
            "was loaded. It passed its sha256 check, so it was written that way: load another "
            "checkpoint"
        ) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{str(file)!r} does not hold DCP metadata; nothing was loaded")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with `.metadata` read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner on a flat state dict, reading non-tensor items with weights_only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
