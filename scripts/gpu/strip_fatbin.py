"""Zeroes every cubin in a shared library's `.nv_fatbin` that is not for one GPU architecture.

    python scripts/gpu/strip_fatbin.py --keep 90 site/fbgemm_gpu/*.so

fbgemm-gpu's wheel carries each kernel for sm_80, sm_90 and sm_100 (2.5 GB unpacked). A machine
with one kind of GPU loads only its own; the others' payloads are zeroed in place (headers and
offsets untouched, so the file's layout does not change) and then compress to nothing: the
stack for an H100 packs into 59 MiB of xz instead of 465 MiB. PTX entries are kept.
"""

from __future__ import annotations

import argparse
import struct
import subprocess
from typing import Iterator

FATBIN_MAGIC = 0xBA55ED50
KIND_ELF = 2


def _section(path: str) -> tuple[int, int] | None:
    """(file offset, size) of `.nv_fatbin`, from readelf; None without one."""
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    return None


def entries(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(kind, arch, payload offset, padded payload size) of each entry of each fatbin."""
    off = start
    while off < end:
        magic, _version, header, size = struct.unpack_from("<IHHQ", data, off)
        if magic != FATBIN_MAGIC:
            off += 8  # padding between fatbins
            continue
        entry, stop = off + header, off + header + size
        while entry < stop:
            kind, _ver, entry_header, padded = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            yield kind, arch, entry + entry_header, padded
            entry += entry_header + padded
        off = stop


def strip(path: str, keep: int) -> tuple[int, int]:
    """Zeroes the cubins of `path` not for sm_`keep`; (cubins kept, bytes zeroed)."""
    where = _section(path)
    if where is None:
        return 0, 0
    data = bytearray(open(path, "rb").read())
    kept = zeroed = 0
    for kind, arch, payload, padded in list(entries(bytes(data), where[0], where[0] + where[1])):
        if kind == KIND_ELF and arch != keep:
            data[payload : payload + padded] = bytes(padded)
            zeroed += padded
        else:
            kept += 1
    if kept == 0 and zeroed:
        raise SystemExit(f"{path}: no cubin for sm_{keep}; nothing would run there")
    with open(path, "wb") as f:
        f.write(data)
    return kept, zeroed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep", type=int, default=90, help="the architecture to keep, e.g. 90 for sm_90")
    p.add_argument("libraries", nargs="+")
    a = p.parse_args()
    for path in a.libraries:
        kept, zeroed = strip(path, a.keep)
        print(f"{path}: kept {kept} entries, zeroed {zeroed >> 20} MiB")


if __name__ == "__main__":
    main()
