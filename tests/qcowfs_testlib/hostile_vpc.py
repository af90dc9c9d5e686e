"""Hostile VHD images (qemu's "vpc"): corrupt footers, dynamic-disk headers
and BATs made from qemu-img images. QEMU 7.2 checks every BAT entry against
the file size at open, so every case here is refused at open."""

from __future__ import annotations

import struct
from pathlib import Path

MiB = 1 << 20


def dynamic(h, d: Path) -> Path:
    img = d / "img.vhd"
    h.run("qemu-img", "create", "-q", "-f", "vpc", img, "16M")
    h.run("qemu-io", "-f", "vpc", "-c", "write -q -P 7 0 64k", "-c", "write -q -P 8 6M 64k", img)
    return img


def fixed(h, d: Path) -> Path:
    img = d / "img.vhd"
    h.run("qemu-img", "create", "-q", "-f", "vpc", "-o", "subformat=fixed", img, "16M")
    return img


def write_footer(img: Path, off: int, field: int, fmt: str, value, fix: bool = True) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        b = bytearray(f.read(512))
        struct.pack_into(fmt, b, field, value)
        if fix:
            b[64:68] = bytes(4)
            struct.pack_into(">I", b, 64, (~sum(b)) & 0xFFFFFFFF)
        f.seek(off)
        f.write(b)


def both_footers(img: Path, field: int, fmt: str, value) -> None:
    for off in (0, img.stat().st_size - 512):
        write_footer(img, off, field, fmt, value)


def dyn_field(img: Path, field: int, fmt: str, value) -> None:
    (data_offset,) = struct.unpack(">Q", img.read_bytes()[16:24])
    with open(img, "r+b") as f:
        f.seek(data_offset + field)
        f.write(struct.pack(fmt, value))


def bat_entry(img: Path, index: int, value: int) -> None:
    (data_offset,) = struct.unpack(">Q", img.read_bytes()[16:24])
    with open(img, "rb") as f:
        f.seek(data_offset + 16)
        (table,) = struct.unpack(">Q", f.read(8))
    with open(img, "r+b") as f:
        f.seek(table + 4 * index)
        f.write(struct.pack(">I", value))


def cases(h):
    def make(base, edit):
        def build(d: Path):
            img = base(h, d)
            edit(img)
            return h.Built(img, [img])
        return build

    def truncate(n):
        return lambda img: open(img, "r+b").truncate(n)

    return {
        "vpc_truncated_footer": h.Case(make(dynamic, truncate(300)), h.Refused("cxsparse"),
                                       "file cut inside the footer copy at 0 (its checksummed fields are whole)"),
        "vpc_bad_checksum": h.Case(make(dynamic, lambda img: write_footer(img, 0, 28, ">4s", b"zzzz", fix=False)),
                                   h.Refused("checksum"), "footer byte changed, checksum not"),
        "vpc_block_size_not_power_of_two": h.Case(make(dynamic, lambda img: dyn_field(img, 32, ">I", 3 * MiB)),
                                                  h.Refused("block size"), "block_size 3 MiB"),
        "vpc_block_size_tiny": h.Case(make(dynamic, lambda img: dyn_field(img, 32, ">I", 256)),
                                      h.Refused("block size"), "block_size 256"),
        "vpc_bat_too_small": h.Case(make(dynamic, lambda img: dyn_field(img, 28, ">I", 1)),
                                    h.Refused("too small"), "1 BAT entry for 16 MiB"),
        "vpc_max_table_entries_huge": h.Case(make(dynamic, lambda img: dyn_field(img, 28, ">I", 0x7FFFFFFF)),
                                             h.Refused("max_table_entries|too small"),
                                             "2^31 BAT entries: a 8 GiB table"),
        "vpc_bat_past_eof": h.Case(make(dynamic, lambda img: dyn_field(img, 16, ">Q", 1 << 40)),
                                   h.Refused("BAT"), "BAT offset 1 TiB"),
        "vpc_bat_entry_past_eof": h.Case(make(dynamic, lambda img: bat_entry(img, 3, 0x00FFFFFF)),
                                         h.Refused("truncated"), "block 3 at sector 2^24-1, past the end"),
        "vpc_bat_entry_overflow_bait": h.Case(make(dynamic, lambda img: bat_entry(img, 0, 0xFFFFFFFE)),
                                              h.Refused("truncated"), "block 0 at sector 2^32-2"),
        "vpc_size_too_large": h.Case(make(dynamic, lambda img: (both_footers(img, 28, ">4s", b"win "),
                                                                 both_footers(img, 48, ">Q", 1 << 42))),
                                     h.Refused("2040"), "creator win, current_size 4 TiB"),
        "vpc_dyn_header_past_eof": h.Case(make(dynamic, lambda img: both_footers(img, 16, ">Q", 1 << 50)),
                                          h.Refused("cxsparse"), "data_offset 2^50"),
        "vpc_dyn_header_offset_overflow": h.Case(make(dynamic, lambda img: both_footers(img, 16, ">Q", (1 << 64) - 16)),
                                                 h.Refused("dynamic"), "data_offset 2^64-16"),
        "vpc_fixed_footer_says_dynamic": h.Case(
            make(fixed, lambda img: write_footer(img, img.stat().st_size - 512, 60, ">I", 3)),
            h.Refused("invalid VPC"), "footer only at the end, type dynamic"),
    }
