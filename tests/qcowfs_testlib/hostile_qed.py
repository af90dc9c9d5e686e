"""Hostile QED images for the corpus (tests/qcowfs_testlib/hostile.py loads cases()).

The starting image: 16 MiB, 4 KiB clusters, 4-cluster tables (one L2 table
maps 8 MiB, so L1 entry 0 owns [0, 8M) and entry 1 [8M, 16M)), data at
[0, 1M) and [12M, 13M). Header fields are patched at their offsets in
docs/interop/qed_spec.txt; L1/L2 entries are found by walking the tables."""

from __future__ import annotations

import os
import struct
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
CLUSTER = 4 * KiB

# name: (offset, struct format) of the header fields
FIELDS = {
    "cluster_size": (4, "<I"), "table_size": (8, "<I"), "header_size": (12, "<I"),
    "features": (16, "<Q"), "l1_table_offset": (40, "<Q"), "image_size": (48, "<Q"),
    "backing_filename_offset": (56, "<I"), "backing_filename_size": (60, "<I"),
}
GOOD = ((1 * MiB, 1 * MiB), (12 * MiB, 1 * MiB))


def get(img: Path, name: str) -> int:
    off, fmt = FIELDS[name]
    with open(img, "rb") as f:
        f.seek(off)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def put(img: Path, off: int, fmt: str, value: int) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))


def set_field(img: Path, name: str, value: int) -> None:
    put(img, *FIELDS[name], value)


def l1_entry_at(img: Path, guest: int) -> int:
    """File offset of the L1 entry for guest (4 KiB clusters, 2048-entry tables)."""
    return get(img, "l1_table_offset") + (guest >> 23) * 8


def l2_entry_at(img: Path, guest: int) -> int:
    with open(img, "rb") as f:
        f.seek(l1_entry_at(img, guest))
        l2 = struct.unpack("<Q", f.read(8))[0]
    assert l2, f"{img}: no L2 table for guest {guest:#x}"
    return l2 + ((guest >> 12) & 2047) * 8


def base(h, d: Path) -> Path:
    img = d / "img.qed"
    h.run("qemu-img", "create", "-q", "-f", "qed", "-o", "cluster_size=4096", img, "16M")
    h.run("qemu-io", "-f", "qed", "-c", "write -q -P 1 0 1M", "-c", "write -q -P 2 12M 1M", img)
    return img


def fields(h, **values):
    def edit(img: Path):
        for name, value in values.items():
            set_field(img, name, value(img) if callable(value) else value)
    return h.edited(lambda d: base(h, d), edit)


def truncated(h, size: int):
    return h.edited(lambda d: base(h, d), lambda img: os.truncate(img, size))


def entry_patch(h, where, value):
    """Patches the 64-bit table entry at where(img) to value(img, old)."""
    def edit(img: Path):
        at = where(img)
        put(img, at, "<Q", value(img, h.read_at(img, at, "<Q")))
    return h.edited(lambda d: base(h, d), edit, pristine_fmt="qed")


def backing_self(h):
    def edit(img: Path):
        name = img.name.encode()
        h.write_at(img, 64, name)
        set_field(img, "features", 1)
        set_field(img, "backing_filename_offset", 64)
        set_field(img, "backing_filename_size", len(name))
    return h.edited(lambda d: base(h, d), edit)


def past_eof(img: Path, old: int) -> int:
    return (img.stat().st_size // CLUSTER + 256) * CLUSTER


def cases(h) -> dict:
    first_l2 = lambda img: l2_entry_at(img, 0)  # noqa: E731
    bad_first = h.Eio(bad=((0, CLUSTER), (2 * KiB, 4 * KiB)), good=((CLUSTER, 1 * MiB - CLUSTER), *GOOD))
    bad_l1 = h.Eio(bad=((0, CLUSTER), (4 * MiB, 512)), good=((12 * MiB, 1 * MiB),))
    return {
        "qed_truncated_to_header_cluster": h.Case(truncated(h, CLUSTER), h.Refused("table offset is invalid"),
                                                  "header intact, L1 table past the end (QEMU iotest 116)"),
        "qed_cluster_size_not_power_of_2": h.Case(fields(h, cluster_size=3 * 4096), h.Refused("cluster size"),
                                                  "cluster_size 12288"),
        "qed_table_size_absurd": h.Case(fields(h, table_size=0x80000000), h.Refused("table size"),
                                        "table_size 2^31: L2 allocation bait"),
        "qed_image_size_huge": h.Case(fields(h, image_size=1 << 62), h.Refused("image size"),
                                      "image_size past what the tables can map"),
        "qed_l1_offset_past_eof": h.Case(fields(h, l1_table_offset=1 << 40), h.Refused("table offset"),
                                         "L1 table past the end of the file"),
        "qed_unknown_feature": h.Case(fields(h, features=0x100), h.Refused("unsupported qed features"),
                                      "unknown feature bit"),
        "qed_header_size_huge": h.Case(fields(h, header_size=0xFFFFFFFF), h.Refused("table offset|header size"),
                                       "header_size * cluster_size overflow bait"),
        "qed_backing_name_overflow": h.Case(fields(h, features=1, backing_filename_offset=0xFFFFFFFF,
                                                   backing_filename_size=0xFFFFFFFF),
                                            h.Refused("backing filename offset"), "offset + size wraps 32 bits"),
        "qed_backing_self": h.Case(backing_self(h), h.Refused("loop|circular|cycle"), "the image backs itself"),
        "qed_l2_entry_past_eof": h.Case(entry_patch(h, first_l2, past_eof), bad_first, "data cluster past the end"),
        "qed_l2_entry_unaligned": h.Case(entry_patch(h, first_l2, lambda img, old: old + 512), bad_first,
                                         "data cluster offset not cluster-aligned"),
        "qed_l1_entry_past_eof": h.Case(entry_patch(h, lambda img: l1_entry_at(img, 0), past_eof), bad_l1,
                                        "L2 table past the end"),
    }
