"""Low-level editing of qcow2 metadata for the hostile-image corpus.

Locates and patches L1, L2 (standard and extended), refcount table and
snapshot table entries of images made by qemu-img, so each corrupt case is a
recipe applied to a valid image. Header fields go through
tests/images/qcow2_header.py. Offsets and masks follow QEMU's
docs/interop/qcow2.txt. Only test code uses this; not thread-safe.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images"))

import qcow2_header as hdr  # noqa: E402

L1_OFFSET_MASK = 0x00FFFFFFFFFFFE00
L2_OFFSET_MASK = 0x00FFFFFFFFFFFE00
OFLAG_COPIED = 1 << 63
OFLAG_COMPRESSED = 1 << 62
OFLAG_ZERO = 1
INCOMPAT_EXTENDED_L2 = 1 << 4
SNAPSHOT_HEADER_SIZE = 40


def read_u64(path: str | os.PathLike, off: int) -> int:
    with open(path, "rb") as f:
        f.seek(off)
        data = f.read(8)
    assert len(data) == 8, f"{path}: no 8 bytes at {off:#x}"
    return struct.unpack(">Q", data)[0]


def write_bytes(path: str | os.PathLike, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def write_u64(path: str | os.PathLike, off: int, value: int) -> None:
    write_bytes(path, off, struct.pack(">Q", value & (2**64 - 1)))


def write_u32(path: str | os.PathLike, off: int, value: int) -> None:
    write_bytes(path, off, struct.pack(">I", value & (2**32 - 1)))


def write_u16(path: str | os.PathLike, off: int, value: int) -> None:
    write_bytes(path, off, struct.pack(">H", value & 0xFFFF))


def cluster_bits(path: str | os.PathLike) -> int:
    return hdr.get_field(path, "cluster_bits")


def cluster_size(path: str | os.PathLike) -> int:
    return 1 << cluster_bits(path)


def extended_l2(path: str | os.PathLike) -> bool:
    return hdr.get_field(path, "version") >= 3 and bool(
        hdr.get_field(path, "incompatible_features") & INCOMPAT_EXTENDED_L2)


def l2_entry_size(path: str | os.PathLike) -> int:
    return 16 if extended_l2(path) else 8


def l1_entry_offset(path: str | os.PathLike, guest: int) -> int:
    """File offset of the L1 entry covering guest offset guest."""
    per_l2 = cluster_size(path) // l2_entry_size(path)
    index = (guest >> cluster_bits(path)) // per_l2
    return hdr.get_field(path, "l1_table_offset") + 8 * index


def l2_table_offset(path: str | os.PathLike, guest: int) -> int:
    l2 = read_u64(path, l1_entry_offset(path, guest)) & L1_OFFSET_MASK
    assert l2, f"{path}: guest offset {guest:#x} has no L2 table"
    return l2


def l2_entry_offset(path: str | os.PathLike, guest: int) -> int:
    """File offset of the L2 entry (its first 8 bytes) mapping guest offset guest."""
    per_l2 = cluster_size(path) // l2_entry_size(path)
    index = (guest >> cluster_bits(path)) % per_l2
    return l2_table_offset(path, guest) + index * l2_entry_size(path)


def get_l2_entry(path: str | os.PathLike, guest: int) -> int:
    return read_u64(path, l2_entry_offset(path, guest))


def set_l2_entry(path: str | os.PathLike, guest: int, value: int) -> None:
    write_u64(path, l2_entry_offset(path, guest), value)


def set_l2_bitmap(path: str | os.PathLike, guest: int, bitmap: int) -> None:
    """Subcluster bitmap of an extended L2 entry (alloc bits 0-31, zero bits 32-63)."""
    assert extended_l2(path), f"{path} has no extended L2 entries"
    write_u64(path, l2_entry_offset(path, guest) + 8, bitmap)


def set_l1_entry(path: str | os.PathLike, guest: int, value: int) -> None:
    write_u64(path, l1_entry_offset(path, guest), value)


def compressed_fields(path: str | os.PathLike, entry: int) -> tuple[int, int]:
    """(host offset, additional sectors) of a compressed descriptor."""
    x = 62 - (cluster_bits(path) - 8)
    return entry & ((1 << x) - 1), (entry >> x) & ((1 << (cluster_bits(path) - 8)) - 1)


def compressed_entry(path: str | os.PathLike, host: int, sectors: int) -> int:
    x = 62 - (cluster_bits(path) - 8)
    assert host < (1 << x) and sectors < (1 << (cluster_bits(path) - 8))
    return OFLAG_COMPRESSED | (sectors << x) | host


def refcount_table_entry_offset(path: str | os.PathLike, index: int = 0) -> int:
    return hdr.get_field(path, "refcount_table_offset") + 8 * index


def first_snapshot_offset(path: str | os.PathLike) -> int:
    assert hdr.get_field(path, "nb_snapshots") >= 1, f"{path} has no snapshot"
    return hdr.get_field(path, "snapshots_offset")


def truncate(path: str | os.PathLike, size: int) -> None:
    os.truncate(path, size)
