"""The one qcow2 metadata reader and editor of the tests: header fields,
header extensions and the snapshot table; L1 and L2 entries (standard and
extended), compressed descriptors and the refcount table (functions taking a
path, for the hostile corpus's recipes); and Qcow2, an object over one image
for reading and damaging L1/L2 entries and refcounts (what `qemu-img check`
then reports as leaking or corrupt).

Offsets and masks follow QEMU's docs/interop/qcow2.txt; every value is
big-endian. Only test code uses this, on files it made and owns. Not
thread-safe.
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


# --------------------------------------------------------------------------
# L1/L2 entries, compressed descriptors, refcount table (path-based)

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
    return get_field(path, "cluster_bits")


def cluster_size(path: str | os.PathLike) -> int:
    return 1 << cluster_bits(path)


def extended_l2(path: str | os.PathLike) -> bool:
    return get_field(path, "version") >= 3 and bool(
        get_field(path, "incompatible_features") & INCOMPAT_EXTENDED_L2)


def l2_entry_size(path: str | os.PathLike) -> int:
    return 16 if extended_l2(path) else 8


def l2_indexes(path: str | os.PathLike, guest: int) -> tuple[int, int]:
    """(L1 index, index in its L2 table) of guest offset guest."""
    per_l2 = cluster_size(path) // l2_entry_size(path)
    return divmod(guest >> cluster_bits(path), per_l2)


def l2_table_at(path: str | os.PathLike, l1_index: int) -> int:
    """File offset of the L2 table L1 entry l1_index points to (0: none)."""
    return read_u64(path, get_field(path, "l1_table_offset") + 8 * l1_index) & L1_OFFSET_MASK


def l1_entry_offset(path: str | os.PathLike, guest: int) -> int:
    """File offset of the L1 entry covering guest offset guest."""
    return get_field(path, "l1_table_offset") + 8 * l2_indexes(path, guest)[0]


def l2_table_offset(path: str | os.PathLike, guest: int) -> int:
    l2 = l2_table_at(path, l2_indexes(path, guest)[0])
    assert l2, f"{path}: guest offset {guest:#x} has no L2 table"
    return l2


def l2_entry_offset(path: str | os.PathLike, guest: int) -> int:
    """File offset of the L2 entry (its first 8 bytes) mapping guest offset guest."""
    return l2_table_offset(path, guest) + l2_indexes(path, guest)[1] * l2_entry_size(path)


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
    return get_field(path, "refcount_table_offset") + 8 * index


def first_snapshot_offset(path: str | os.PathLike) -> int:
    assert get_field(path, "nb_snapshots") >= 1, f"{path} has no snapshot"
    return get_field(path, "snapshots_offset")


def truncate(path: str | os.PathLike, size: int) -> None:
    os.truncate(path, size)


# --------------------------------------------------------------------------
# One image as an object: table walks and refcounts

# The names qemu-img check's tests use.
OFFSET_MASK = L2_OFFSET_MASK
COPIED = OFLAG_COPIED
COMPRESSED = OFLAG_COMPRESSED


class Qcow2:
    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.cluster_bits = cluster_bits(path)
        self.cs = 1 << self.cluster_bits
        self.version = get_field(path, "version")
        self.refcount_order = get_field(path, "refcount_order") if self.version >= 3 else 4
        self.extended_l2 = extended_l2(path)
        self.l2_entry_size = l2_entry_size(path)
        self.l1_offset = get_field(path, "l1_table_offset")
        self.l1_size = get_field(path, "l1_size")
        self.reftable_offset = get_field(path, "refcount_table_offset")

    # -- raw access
    def read(self, off: int, n: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(off)
            return f.read(n).ljust(n, b"\0")

    def write(self, off: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.seek(off)
            f.write(data)

    def u64(self, off: int) -> int:
        return struct.unpack(">Q", self.read(off, 8))[0]

    def put_u64(self, off: int, v: int) -> None:
        self.write(off, struct.pack(">Q", v))

    def file_size(self) -> int:
        return os.path.getsize(self.path)

    # -- tables
    def l1_entry_offset(self, i: int) -> int:
        return self.l1_offset + 8 * i

    def l2_offset(self, l1_index: int) -> int:
        return l2_table_at(self.path, l1_index)

    def l2_entry_offset(self, l1_index: int, j: int) -> int:
        return self.l2_offset(l1_index) + j * self.l2_entry_size

    def first_data_entry(self) -> tuple[int, int]:
        """(l1 index, l2 index) of the first allocated, uncompressed data cluster."""
        for i in range(self.l1_size):
            if not self.l2_offset(i):
                continue
            for j in range(self.cs // self.l2_entry_size):
                e = self.u64(self.l2_entry_offset(i, j))
                if e & OFFSET_MASK and not e & COMPRESSED:
                    return i, j
        raise AssertionError(f"{self.path} has no allocated data cluster")

    # -- refcounts
    def _refcount_location(self, cluster: int) -> tuple[int, int, int]:
        bits = 1 << self.refcount_order
        per_block = self.cs * 8 // bits
        block = self.u64(self.reftable_offset + 8 * (cluster // per_block)) & ~0x1FF & (2**64 - 1)
        assert block, f"no refcount block covers cluster {cluster}"
        index = cluster % per_block
        return block, index, bits

    def refcount(self, cluster: int) -> int:
        block, index, bits = self._refcount_location(cluster)
        if bits >= 8:
            n = bits // 8
            return int.from_bytes(self.read(block + index * n, n), "big")
        byte = self.read(block + index * bits // 8, 1)[0]
        shift = (index * bits) % 8
        return (byte >> shift) & ((1 << bits) - 1)

    def set_refcount(self, cluster: int, value: int) -> None:
        block, index, bits = self._refcount_location(cluster)
        if bits >= 8:
            n = bits // 8
            self.write(block + index * n, value.to_bytes(n, "big"))
            return
        pos = block + index * bits // 8
        shift = (index * bits) % 8
        mask = ((1 << bits) - 1) << shift
        byte = self.read(pos, 1)[0]
        self.write(pos, bytes([(byte & ~mask) | ((value << shift) & mask)]))
