"""Hostile Parallels images: corrupt headers, BAT sizes and entries, and format
extensions, made from qemu-img images."""

from __future__ import annotations

import struct
from pathlib import Path

MiB = 1 << 20


def plain(h, d: Path) -> Path:
    """8 MiB, 1 MiB clusters: clusters at guest 0, 3M and 6M allocated."""
    img = d / "img.hds"
    h.run("qemu-img", "create", "-q", "-f", "parallels", img, "8M")
    h.run("qemu-io", "-f", "parallels", "-c", "write -q -P 7 0 1M", "-c", "write -q -P 8 3M 1M",
          "-c", "write -q -P 9 6M 64k", img)
    return img


def poke(img: Path, off: int, fmt: str, value) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))


def seal_extension(img: Path, corrupt: bool) -> None:
    """Appends an extension cluster with no features and its MD5 (flipped if corrupt)."""
    import hashlib
    data = bytearray(img.read_bytes())
    cluster = struct.unpack_from("<I", data, 28)[0] * 512
    at = (len(data) + cluster - 1) // cluster * cluster
    body = bytes(cluster - 24)
    digest = bytearray(hashlib.md5(body).digest())
    digest[0] ^= 1 if corrupt else 0
    data += bytes(at - len(data)) + struct.pack("<Q", 0xAB234CEF23DCEA87) + digest + body
    struct.pack_into("<Q", data, 56, at // 512)
    img.write_bytes(data)


def cases(h):
    def make(edit, pristine: bool = False):
        def build(d: Path):
            img = plain(h, d)
            raw = None
            if pristine:
                raw = img.with_suffix(".pristine.raw")
                h.run("qemu-img", "convert", "-f", "parallels", "-O", "raw", img, raw)
            edit(img)
            return h.Built(img, [img], raw)
        return build

    return {
        "parallels_truncated_header": h.Case(make(lambda img: open(img, "r+b").truncate(20)),
                                             h.Refused("zero sectors"), "file cut inside the header"),
        "parallels_bad_version": h.Case(make(lambda img: poke(img, 16, "<I", 3)),
                                        h.Refused("not in Parallels format"), "version 3"),
        "parallels_tracks_zero": h.Case(make(lambda img: poke(img, 28, "<I", 0)),
                                        h.Refused("zero sectors"), "cluster of 0 sectors"),
        "parallels_tracks_huge": h.Case(make(lambda img: poke(img, 28, "<I", 0x7FFFFFFF)),
                                        h.Refused("too big cluster"), "cluster of 2^31 sectors"),
        "parallels_bat_entries_huge": h.Case(make(lambda img: poke(img, 32, "<I", 0xFFFFFFFF)),
                                             h.Refused("catalog too large"), "2^32 BAT entries"),
        "parallels_bat_entries_2gib": h.Case(make(lambda img: poke(img, 32, "<I", 0x1FFFFFFF)),
                                             h.Refused("too large to read"),
                                             "a 2 GiB BAT: QEMU's one header read fails"),
        "parallels_ext_bad_magic": h.Case(make(lambda img: poke(img, 56, "<Q", 1)),
                                          h.Refused("extension magic"), "format extension at sector 1 (BAT)"),
        "parallels_ext_bad_checksum": h.Case(make(lambda img: seal_extension(img, corrupt=True)),
                                             h.Refused("checksum"), "format extension whose MD5 is wrong"),
        "parallels_ext_past_eof": h.Case(make(lambda img: poke(img, 56, "<Q", 1 << 40)),
                                         h.Refused("extension magic"), "format extension past the end"),
        "parallels_ext_offset_overflow": h.Case(make(lambda img: poke(img, 56, "<Q", (1 << 64) - 1)),
                                                h.Refused("extension"), "format extension at sector 2^64-1"),
        "parallels_bat_entry_past_eof": h.Case(make(lambda img: poke(img, 64 + 3 * 4, "<I", 0xFFFFFF), True),
                                               h.Eio(bad=((3 * MiB, MiB),), good=((0, 3 * MiB), (4 * MiB, 4 * MiB))),
                                               "cluster 3 at 16 TiB"),
        "parallels_nb_sectors_overflow": h.Case(make(lambda img: poke(img, 36, "<Q", (1 << 64) - 1)),
                                                h.Refused("too large"), "nb_sectors 2^64-1: bytes overflow"),
    }
