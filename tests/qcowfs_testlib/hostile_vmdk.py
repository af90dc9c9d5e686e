"""Hostile VMDK images (tests/qcowfs_testlib/hostile.py loads this module): corrupt
sparse headers, grain-directory and grain-table entries past the end of the
file, a streamOptimized grain whose marker points past the end or whose footer
is cut off, descriptors that are too large, list nothing or name themselves,
a delta disk that is its own parent, and one whose parentCID is not its
parent's CID (the parent changed since: refused at open, as VMware does)."""

from __future__ import annotations

import struct
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
SIZE = 16 * MiB

# KDMV header field offsets (image/vmdk/format.h).
CAPACITY, GRANULARITY, NUM_GTES, GD_OFFSET = 12, 20, 44, 56


def qemu_raw(h, img: Path) -> Path:
    out = img.with_suffix(".qemu-ref.raw")
    h.run("qemu-img", "convert", "-f", "vmdk", "-O", "raw", img, out)
    return out


def sparse(h, d: Path, *, stream: bool = False) -> Path:
    """16 MiB, data at [0,64K), [1M,1M+128K) and [9M,9M+4K)."""
    img = d / "img.vmdk"
    cmds = ["write -q -P 1 0 64k", "write -q -P 2 1M 128k", "write -q -P 3 9M 4k"]
    if stream:
        raw = d / "src.raw"
        h.run("qemu-img", "create", "-q", "-f", "raw", raw, str(SIZE))
        h.run("qemu-io", "-f", "raw", *sum([["-c", c] for c in cmds], []), raw)
        h.run("qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat=streamOptimized", raw, img)
        raw.unlink()
    else:
        h.run("qemu-img", "create", "-q", "-f", "vmdk", img, str(SIZE))
        h.run("qemu-io", "-f", "vmdk", *sum([["-c", c] for c in cmds], []), img)
    return img


def poke(img: Path, off: int, fmt: str, value: int) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))


def header(img: Path, at: int = 0) -> bytes:
    with open(img, "rb") as f:
        f.seek(at)
        return f.read(512)


def gd_offset(img: Path) -> int:
    """Byte offset of the GD, from the footer when the header says "at end"."""
    gd = struct.unpack_from("<Q", header(img), GD_OFFSET)[0]
    if gd == (1 << 64) - 1:
        size = img.stat().st_size
        gd = struct.unpack_from("<Q", header(img, (size + 511) // 512 * 512 - 1024), GD_OFFSET)[0]
    return gd * 512


def gt_entry_offset(img: Path, guest: int, grain: int = 64 * KiB, gtes: int = 512) -> int:
    gd = gd_offset(img)
    with open(img, "rb") as f:
        f.seek(gd + guest // (grain * gtes) * 4)
        gt = struct.unpack("<I", f.read(4))[0] * 512
    return gt + (guest // grain) % gtes * 4


def readable(h, img: Path, *others: Path):
    """For h.Readable(): qemu-img converts it with -f vmdk."""
    return h.Built(img, [img, *others], extra={"format": "vmdk"})


def header_field(off: int, fmt: str, value: int):
    def make(h, d: Path):
        img = sparse(h, d)
        poke(img, off, fmt, value)
        return h.Built(img, [img])
    return make


def stream_grain_huge(h, d: Path):
    img = sparse(h, d, stream=True)
    poke(img, GRANULARITY, "<Q", 0x100000)
    return h.Built(img, [img])


def gd_entry_past_eof(h, d: Path):
    img = sparse(h, d)
    poke(img, gd_offset(img), "<I", 0x7FFFFF00)
    return readable(h, img)


def gt_entry_past_eof(h, d: Path):
    img = sparse(h, d)
    poke(img, gt_entry_offset(img, 1 * MiB), "<I", 0x7FFFFF00)
    return readable(h, img)


def compressed_grain_past_eof(h, d: Path):
    img = stream_gd_at_end(h, d)
    pristine = qemu_raw(h, img)
    poke(img, gt_entry_offset(img, 1 * MiB), "<I", 0x7FFFFF00)
    return h.Built(img, [img], pristine)


def compressed_grain_size_huge(h, d: Path):
    img = sparse(h, d, stream=True)
    pristine = qemu_raw(h, img)
    with open(img, "rb") as f:
        f.seek(gt_entry_offset(img, 1 * MiB))
        grain = struct.unpack("<I", f.read(4))[0] * 512
    poke(img, grain + 8, "<I", 0xFFFFFFF0)
    return h.Built(img, [img], pristine)


def move_gd_to_footer(img: Path) -> None:
    """What VMware's streamOptimized writers do and qemu-img does not: the header's GD
    offset says "at end" and a footer (marker, header copy, end-of-stream marker) ends the file."""
    head = bytearray(header(img))
    pad = (-img.stat().st_size) % 512
    footer_marker = struct.pack("<QII", 1, 0, 3).ljust(512, b"\0")
    eos = bytes(512)
    with open(img, "r+b") as f:
        f.seek(0, 2)
        f.write(bytes(pad) + footer_marker + bytes(head) + eos)
    poke(img, GD_OFFSET, "<Q", (1 << 64) - 1)


def stream_gd_at_end(h, d: Path):
    img = sparse(h, d, stream=True)
    move_gd_to_footer(img)
    return img


def stream_footer_truncated(h, d: Path):
    img = stream_gd_at_end(h, d)
    with open(img, "r+b") as f:
        f.truncate(img.stat().st_size - 512)
    return h.Built(img, [img])


def descriptor(text: str):
    def make(h, d: Path):
        extent = d / "data.bin"
        extent.write_bytes(b"\x5a" * MiB)
        img = d / "img.vmdk"
        img.write_text(text)
        return h.Built(img, [img, extent])
    return make


DESC_HEAD = '# Disk DescriptorFile\nversion=1\nCID=1234abcd\nparentCID=ffffffff\ncreateType="monolithicFlat"\n'


def descriptor_too_large(h, d: Path):
    """The extent line lies past the 1 MiB QEMU reads of a descriptor."""
    extent = d / "data.bin"
    extent.write_bytes(b"\x5a" * MiB)
    img = d / "img.vmdk"
    img.write_text(DESC_HEAD + "#" * (2 * MiB) + '\nRW 2048 FLAT "data.bin" 0\n')
    return h.Built(img, [img, extent])


def parent_is_itself(h, d: Path):
    base, delta = d / "base.vmdk", d / "img.vmdk"
    h.run("qemu-img", "create", "-q", "-f", "vmdk", base, str(SIZE))
    h.run("qemu-img", "create", "-q", "-f", "vmdk", "-b", base.name, "-F", "vmdk", delta)
    data = bytearray(delta.read_bytes())
    at = data.index(b'parentFileNameHint="base.vmdk"')
    data[at:at + 30] = b'parentFileNameHint="img.vmdk"\n'
    delta.write_bytes(bytes(data))
    return h.Built(delta, [delta, base])


def parent_cid_stale(h, d: Path):
    """A delta whose parentCID was edited: its parent is not the one it was made on."""
    base, delta = d / "base.vmdk", d / "img.vmdk"
    h.run("qemu-img", "create", "-q", "-f", "vmdk", base, str(SIZE))
    h.run("qemu-img", "create", "-q", "-f", "vmdk", "-b", base.name, "-F", "vmdk", delta)
    data = bytearray(delta.read_bytes())
    at = data.index(b"parentCID=", 0x200) + len(b"parentCID=")
    end = data.index(b"\n", at)
    data[at:end] = b"%0*x" % (end - at, int(data[at:end], 16) ^ 1)  # same length: the descriptor stays in place
    delta.write_bytes(bytes(data))
    return h.Built(delta, [delta, base])


def cases(h) -> dict:
    def bind(make):
        return lambda d: make(h, d)

    return {
        "vmdk_gd_entry_past_eof": h.Case(bind(gd_entry_past_eof), h.Readable(),
                                         "grain table past EOF: QEMU reads zeros, all unallocated"),
        "vmdk_gt_entry_past_eof": h.Case(bind(gt_entry_past_eof), h.Readable(),
                                         "grain past EOF: QEMU reads zeros"),
        "vmdk_capacity_absurd": h.Case(bind(header_field(CAPACITY, "<Q", 1 << 62)), h.Refused("capacity|absurd"),
                                       "capacity 2^62 sectors"),
        "vmdk_grain_size_zero": h.Case(bind(header_field(GRANULARITY, "<Q", 0)), h.Refused("grain"),
                                       "grain size 0: no GD entry coverage"),
        "vmdk_grain_size_huge": h.Case(bind(header_field(GRANULARITY, "<Q", 1 << 40)), h.Refused("grain size"),
                                       "grain size of 2^40 sectors"),
        "vmdk_compressed_grain_512m": h.Case(bind(stream_grain_huge), h.Refused("compressed grains"),
                                             "streamOptimized grains of 512 MiB (inflated in memory)"),
        "vmdk_gtes_absurd": h.Case(bind(header_field(NUM_GTES, "<I", 0x10000)), h.Refused("grain tables"),
                                   "65536 entries per grain table (QEMU: at most 512)"),
        "vmdk_descriptor_too_large": h.Case(bind(descriptor_too_large), h.Refused("no extents"),
                                            "extent line after the first MiB"),
        "vmdk_descriptor_without_extents": h.Case(bind(descriptor(DESC_HEAD + "# no extents\n")),
                                                  h.Refused("no extents"), "descriptor lists nothing"),
        "vmdk_extent_names_itself": h.Case(bind(descriptor(DESC_HEAD + 'RW 2048 FLAT "img.vmdk" 0\n')),
                                           h.Refused("descriptor itself"), "a FLAT extent that is the descriptor"),
        "vmdk_parent_is_itself": h.Case(bind(parent_is_itself), h.Refused("loop"),
                                        "delta whose parentFileNameHint names itself"),
        "vmdk_parent_cid_stale": h.Case(bind(parent_cid_stale), h.Refused("modified since"),
                                        "delta whose parentCID is not its parent's CID"),
        "vmdk_compressed_grain_past_eof": h.Case(
            bind(compressed_grain_past_eof), h.Eio(((1 * MiB, 64 * KiB),), ((0, 64 * KiB), (9 * MiB, 4 * KiB))),
            "streamOptimized grain marker past EOF: size 0"),
        "vmdk_compressed_grain_size_huge": h.Case(
            bind(compressed_grain_size_huge), h.Eio(((1 * MiB, 64 * KiB),), ((0, 64 * KiB), (1 * MiB + 64 * KiB, 64 * KiB))),
            "grain marker size larger than two grains"),
        "vmdk_stream_footer_truncated": h.Case(bind(stream_footer_truncated), h.Refused("footer"),
                                               "last sector of a streamOptimized file with its GD at the end cut off"),
    }
