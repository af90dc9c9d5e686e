"""Reads and patches qcow2 header fields in place, to build hostile test images.

Field offsets follow docs/interop/qcow2.txt (big-endian). Only test code uses
this; it edits files the caller made and owns. Not thread-safe.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

# name: (offset, struct format)
FIELDS = {
    "magic": (0, ">I"),
    "version": (4, ">I"),
    "backing_file_offset": (8, ">Q"),
    "backing_file_size": (16, ">I"),
    "cluster_bits": (20, ">I"),
    "size": (24, ">Q"),
    "crypt_method": (32, ">I"),
    "l1_size": (36, ">I"),
    "l1_table_offset": (40, ">Q"),
    "refcount_table_offset": (48, ">Q"),
    "refcount_table_clusters": (56, ">I"),
    "nb_snapshots": (60, ">I"),
    "snapshots_offset": (64, ">Q"),
    "incompatible_features": (72, ">Q"),
    "compatible_features": (80, ">Q"),
    "autoclear_features": (88, ">Q"),
    "refcount_order": (96, ">I"),
    "header_length": (100, ">I"),
}

EXT_END = 0
EXT_FEATURE_NAMES = 0x6803F857
FEATURE_ENTRY = struct.Struct(">BB46s")
FEATURE_INCOMPATIBLE = 0
INCOMPAT_DIRTY = 1 << 0
INCOMPAT_CORRUPT = 1 << 1


def get_field(path: str | os.PathLike, name: str) -> int:
    off, fmt = FIELDS[name]
    with open(path, "rb") as f:
        f.seek(off)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def set_field(path: str | os.PathLike, name: str, value: int) -> None:
    off, fmt = FIELDS[name]
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))


def read_extensions(path: str | os.PathLike) -> list[tuple[int, bytes]]:
    """Header extensions (type, data) in file order, without the end marker."""
    data = Path(path).read_bytes()
    pos = get_field(path, "header_length") if get_field(path, "version") >= 3 else 72
    exts = []
    while pos + 8 <= len(data):
        etype, length = struct.unpack_from(">II", data, pos)
        if etype == EXT_END:
            return exts
        exts.append((etype, data[pos + 8: pos + 8 + length]))
        pos += 8 + (length + 7) // 8 * 8
    raise ValueError(f"{path}: header extensions run past the end of the file")


def write_extensions(path: str | os.PathLike, exts: list[tuple[int, bytes]]) -> None:
    """Rewrites the extension area; it must still fit before the backing name."""
    start = get_field(path, "header_length") if get_field(path, "version") >= 3 else 72
    blob = b"".join(struct.pack(">II", t, len(d)) + d + b"\0" * (-len(d) % 8) for t, d in exts)
    blob += struct.pack(">II", EXT_END, 0)
    limit = get_field(path, "backing_file_offset") or (1 << get_field(path, "cluster_bits"))
    if start + len(blob) > limit:
        raise ValueError(f"{path}: extensions would overlap the backing file name")
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(blob)


def set_incompatible_bit(path: str | os.PathLike, bit: int, name: str | None = None) -> None:
    """Sets an incompatible feature bit; with name, also lists it in the feature name table."""
    set_field(path, "incompatible_features", get_field(path, "incompatible_features") | (1 << bit))
    if name is None:
        return
    entry = FEATURE_ENTRY.pack(FEATURE_INCOMPATIBLE, bit, name.encode())
    exts = read_extensions(path)
    for i, (etype, data) in enumerate(exts):
        if etype == EXT_FEATURE_NAMES:
            exts[i] = (etype, data + entry)
            break
    else:
        exts.append((EXT_FEATURE_NAMES, entry))
    write_extensions(path, exts)


SNAPSHOT_HEADER = struct.Struct(">QIHHIIQII")  # l1 offset/size, id/name lengths, dates, vm state, extra


def read_snapshots(path: str | os.PathLike) -> list[dict]:
    """The snapshot table: id, name and disk_size of each entry (disk_size None if unrecorded)."""
    data = Path(path).read_bytes()
    pos = get_field(path, "snapshots_offset")
    out = []
    for _ in range(get_field(path, "nb_snapshots")):
        (_, _, id_len, name_len, _, _, _, _, extra_len) = SNAPSHOT_HEADER.unpack_from(data, pos)
        pos += SNAPSHOT_HEADER.size
        extra = data[pos: pos + extra_len]
        pos += extra_len
        disk_size = struct.unpack_from(">Q", extra, 8)[0] if extra_len >= 16 else None
        sid = data[pos: pos + id_len].decode()
        pos += id_len
        name = data[pos: pos + name_len].decode()
        pos += name_len
        pos += -pos % 8
        out.append({"id": sid, "name": name, "disk_size": disk_size})
    return out
