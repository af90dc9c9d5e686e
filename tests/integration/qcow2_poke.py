"""Reads and damages qcow2 metadata (L1/L2 entries, refcounts, refcount table)
in place, to make images that `qemu-img check` reports as leaking or corrupt.

Only test code uses this, on copies it owns. Offsets follow QEMU's
docs/interop/qcow2.txt; every value is big-endian. Not thread-safe.
"""

from __future__ import annotations

import os
import struct

import qcow2_header

OFFSET_MASK = 0x00FFFFFFFFFFFE00
COPIED = 1 << 63
COMPRESSED = 1 << 62


class Qcow2:
    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.cluster_bits = qcow2_header.get_field(path, "cluster_bits")
        self.cs = 1 << self.cluster_bits
        self.version = qcow2_header.get_field(path, "version")
        self.refcount_order = qcow2_header.get_field(path, "refcount_order") if self.version >= 3 else 4
        incompat = qcow2_header.get_field(path, "incompatible_features") if self.version >= 3 else 0
        self.extended_l2 = bool(incompat & (1 << 4))
        self.l2_entry_size = 16 if self.extended_l2 else 8
        self.l1_offset = qcow2_header.get_field(path, "l1_table_offset")
        self.l1_size = qcow2_header.get_field(path, "l1_size")
        self.reftable_offset = qcow2_header.get_field(path, "refcount_table_offset")

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
        return self.u64(self.l1_entry_offset(l1_index)) & OFFSET_MASK

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
