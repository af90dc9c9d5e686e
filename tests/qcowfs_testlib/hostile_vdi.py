"""Hostile VDI images for the corpus (tests/qcowfs_testlib/hostile.py loads cases()).

The starting image: a dynamic 8 MiB VDI with data in blocks 0, 1 and 5
([0, 2M) and [5M, 6M)). Header fields are patched at the offsets of QEMU's
VdiHeader (block/vdi.c); block map entries at offset_bmap + 4 * block."""

from __future__ import annotations

import os
import struct
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20

FIELDS = {
    "version": (68, "<I"), "offset_bmap": (340, "<I"), "offset_data": (344, "<I"),
    "sector_size": (360, "<I"), "disk_size": (368, "<Q"), "block_size": (376, "<I"),
    "blocks_in_image": (384, "<I"),
}
UUID_LINK, UUID_PARENT = 424, 440


def get(img: Path, name: str) -> int:
    off, fmt = FIELDS[name]
    with open(img, "rb") as f:
        f.seek(off)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def put(img: Path, off: int, data: bytes) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(data)


def base(h, d: Path) -> Path:
    img = d / "img.vdi"
    h.run("qemu-img", "create", "-q", "-f", "vdi", img, "8M")
    h.run("qemu-io", "-f", "vdi", "-c", "write -q -P 1 0 2M", "-c", "write -q -P 2 5M 1M", img)
    return img


def fields(h, **values):
    def edit(img: Path):
        for name, value in values.items():
            off, fmt = FIELDS[name]
            put(img, off, struct.pack(fmt, value(img) if callable(value) else value))
    return h.edited(lambda d: base(h, d), edit)


def raw_patch(h, off: int, data: bytes):
    return h.edited(lambda d: base(h, d), lambda img: put(img, off, data))


def truncated(h, size: int):
    return h.edited(lambda d: base(h, d), lambda img: os.truncate(img, size))


def bmap_patch(h, block: int, value):
    def edit(img: Path):
        put(img, get(img, "offset_bmap") + 4 * block, struct.pack("<I", value(img)))
    return h.edited(lambda d: base(h, d), edit, pristine_fmt="vdi")


def cases(h) -> dict:
    bad_block0 = h.Eio(bad=((0, 4 * KiB), (1 * MiB - 512, 1024)), good=((1 * MiB, 1 * MiB), (5 * MiB, 1 * MiB)))
    return {
        "vdi_truncated_in_header": h.Case(truncated(h, 400), h.Refused("block map"),
                                          "header cut at 400 bytes: the block map is past the end"),
        "vdi_block_size_2m": h.Case(fields(h, block_size=2 * MiB), h.Refused("block size"),
                                    "QEMU reads only 1 MiB blocks"),
        "vdi_disk_size_huge": h.Case(fields(h, disk_size=1 << 60), h.Refused("image size"),
                                     "disk_size past VDI_DISK_SIZE_MAX"),
        "vdi_disk_size_past_bmap": h.Case(fields(h, disk_size=9 * MiB), h.Refused("bitmap has room"),
                                          "disk_size larger than blocks_in_image blocks"),
        "vdi_blocks_in_image_huge": h.Case(fields(h, blocks_in_image=0x40000000), h.Refused("too many blocks"),
                                           "block map allocation bait (4 GiB), past 7.2's 0x1fffff80 limit"),
        "vdi_bmap_past_eof": h.Case(fields(h, offset_bmap=0x7FFFFE00), h.Refused("block map"),
                                    "block map far past the end of the file"),
        "vdi_bmap_unaligned": h.Case(fields(h, offset_bmap=0x201), h.Refused("unaligned block map"),
                                     "block map offset not sector-aligned"),
        "vdi_version_2": h.Case(fields(h, version=0x00020000), h.Refused("version"), "unknown version"),
        "vdi_link_uuid": h.Case(raw_patch(h, UUID_LINK, b"\x01" * 16), h.Refused("link uuid"),
                                "a linked (differencing) image"),
        "vdi_parent_uuid": h.Case(raw_patch(h, UUID_PARENT, b"\x02" * 16), h.Refused("parent uuid"),
                                  "a snapshot with a parent"),
        "vdi_bmap_entry_too_large": h.Case(bmap_patch(h, 0, lambda img: get(img, "blocks_in_image") + 5),
                                           bad_block0, "block map entry not below blocks_in_image"),
        "vdi_bmap_entry_huge": h.Case(bmap_patch(h, 0, lambda img: 0xFFFFFFF0), bad_block0,
                                      "block map entry far past the end of the file"),
    }
