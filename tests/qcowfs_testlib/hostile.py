"""The hostile-image corpus: recipes that turn valid qemu-img images into corrupt ones.

Every case starts from an image made by qemu-img/qemu-io in a directory the
caller owns and applies one corruption (header field, table entry, extension,
snapshot table, chain). Each case carries its expected outcome:

  Refused(pattern)    the mount is refused at open; the message matches pattern.
  Eio(bad, good)      the mount works; reading any bad range fails with EIO;
                      good ranges read exactly what the pristine image held.
  Readable()          QEMU reads the image without complaint (metadata that is
                      only harmful to writers, or pointers into other metadata);
                      the mount must show exactly what `qemu-img convert` shows.

Usage: `PYTHONPATH=tests python3 -m qcowfs_testlib.hostile OUTDIR [CASE...]` writes the images
(one subdirectory per case) and OUTDIR/manifest.json (each case's image and
expected outcome); tests/unit/image/hostile_corpus_test.cc checks every case through
the driver with it, tests/integration/test_hostile.py through a real mount.
Not thread-safe: each call writes files in its own directory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qcowfs_testlib import qcow2_meta as ed

KiB, MiB = 1 << 10, 1 << 20
TOOL_TIMEOUT_S = 120


# --------------------------------------------------------------------------
# Outcomes


@dataclass(frozen=True)
class Refused:
    pattern: str  # "a|b c|d": literal alternatives, one must occur in the message (any case)


@dataclass(frozen=True)
class Eio:
    bad: tuple[tuple[int, int], ...]   # (offset, length) ranges that must fail with EIO
    good: tuple[tuple[int, int], ...]  # ranges that must read as in the pristine image


@dataclass(frozen=True)
class Readable:
    pass


@dataclass
class Built:
    image: Path                       # what to mount
    files: list[Path]                 # every file the mount may open (must stay unchanged)
    pristine_raw: Path | None = None  # raw rendering of the image before the corruption
    extra: dict = field(default_factory=dict)  # "format": the image's format for qemu-img (default qcow2)


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Built]
    outcome: Refused | Eio | Readable
    note: str


# --------------------------------------------------------------------------
# Tools


def run(*args, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=TOOL_TIMEOUT_S, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({proc.returncode}): "
                           f"{proc.stderr.decode(errors='replace')}")
    return proc.stdout.decode()


def qemu_io(image: Path, *cmds: str) -> None:
    args = ["qemu-io", "-f", "qcow2"]
    for c in cmds:
        args += ["-c", c]
    out = run(*args, image.name, cwd=image.parent)
    assert "error" not in out.lower() and "failed" not in out.lower(), out


def to_raw(image: Path, out: Path, fmt: str = "qcow2") -> Path:
    run("qemu-img", "convert", "-f", fmt, "-O", "raw", image, out)
    return out


def read_at(img: Path, off: int, fmt: str) -> int:
    """The value of struct format fmt at file offset off of img."""
    with open(img, "rb") as f:
        f.seek(off)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def write_at(img: Path, off: int, data: bytes) -> None:
    """Overwrites img with data at file offset off."""
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(data)


def edited(base: Callable[[Path], Path], edit: Callable[[Path], None],
           pristine_fmt: str | None = None) -> Callable[[Path], Built]:
    """A case maker for the other formats' modules: base(d) makes the valid
    image, edit(img) damages it in place; with pristine_fmt (the image's
    qemu-img format) its raw rendering is taken before the damage."""
    def make(d: Path) -> Built:
        img = base(d)
        raw = to_raw(img, img.with_suffix(".pristine.raw"), pristine_fmt) if pristine_fmt else None
        edit(img)
        return Built(img, [img], raw)
    return make


# --------------------------------------------------------------------------
# Valid starting images

# The "plain" image: 16 MiB, 4 KiB clusters so one L2 table covers 2 MiB and
# each L1 entry owns a small, separate guest range.
PLAIN_WRITES = (("P1", 1, 0, 1 * MiB), ("P2", 2, 4 * MiB, 64 * KiB),
                ("P3", 3, 8 * MiB, 64 * KiB), ("P4", 4, 12 * MiB, 1 * MiB))


def plain(d: Path, name: str = "img.qcow2") -> Path:
    img = d / name
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", img, "16M")
    qemu_io(img, *[f"write -q -P {p} {off} {n}" for _, p, off, n in PLAIN_WRITES])
    return img


def compressed(d: Path) -> Path:
    """64 KiB clusters: [0,64K) and [64K,128K) compressed, [1M,1M+64K) plain."""
    img = d / "img.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", img, "16M")
    # Compressed streams last, so they end the file.
    qemu_io(img, "write -q -P 7 1M 64k", "write -q -c -P 5 0 64k", "write -q -c -P 6 64k 64k")
    return img


def extended(d: Path) -> Path:
    """Extended L2, 64 KiB clusters (2 KiB subclusters): a full cluster at 0, two
    subclusters at 1M, a zero cluster at 2M, data at 3M."""
    img = d / "img.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "extended_l2=on,cluster_size=65536", img, "16M")
    qemu_io(img, "write -q -P 8 0 64k", "write -q -P 9 1M 4k", "write -q -z 2M 64k",
            "write -q -P 10 3M 64k")
    return img


def with_snapshot(d: Path) -> Path:
    img = plain(d)
    run("qemu-img", "snapshot", "-c", "s1", img)
    qemu_io(img, "write -q -P 11 0 64k")
    return img


def built(img: Path, *others: Path, pristine: bool = False) -> Built:
    raw = to_raw(img, img.with_suffix(".pristine.raw")) if pristine else None
    return Built(img, [img, *others], raw)


# --------------------------------------------------------------------------
# Recipes


def header_fields(base: Callable[[Path], Path] = plain, **fields) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = base(d)
        for name, value in fields.items():
            ed.set_field(img, name, value)
        return built(img)
    return make


def header_fields_from(fn: Callable[[Path], dict]) -> Callable[[Path], Built]:
    """Header fields computed from the valid image (e.g. other fields' values)."""
    def make(d: Path) -> Built:
        img = plain(d)
        for name, value in fn(img).items():
            ed.set_field(img, name, value)
        return built(img)
    return make


def truncated(size: int) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = plain(d)
        ed.truncate(img, size)
        return built(img)
    return make


def incompatible_bit(bit: int, name: str | None = None) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = plain(d)
        ed.set_incompatible_bit(img, bit, name)
        return built(img)
    return make


def extension(etype: int, data: bytes, autoclear: int = 0) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = plain(d)
        ed.set_field(img, "autoclear_features", autoclear)
        ed.write_extensions(img, [*ed.read_extensions(img), (etype, data)])
        return built(img)
    return make


BITMAPS_EXT = 0x23852875
# Directory entry fields: offset and struct format (qcow2 spec, "Bitmap directory").
BITMAP_ENTRY_FIELDS = {"table_offset": (0, ">Q"), "table_size": (8, ">I"), "flags": (12, ">I"), "type": (16, ">B"),
                       "granularity_bits": (17, ">B"), "name_size": (18, ">H")}


def with_bitmap(d: Path) -> tuple[Path, int, int]:
    """plain() with bitmap b0 from qemu-img (no bits set); returns it, the directory offset and the table offset."""
    img = plain(d)
    run("qemu-img", "bitmap", "--add", "-f", "qcow2", img, "b0")
    ext = dict(ed.read_extensions(img))[BITMAPS_EXT]
    dir_offset = struct.unpack(">Q", ext[16:24])[0]
    return img, dir_offset, ed.read_u64(img, dir_offset)


def bitmap_entry(**fields) -> Callable[[Path], Built]:
    """Bitmap b0's directory entry with fields replaced (a callable value gets the directory offset)."""
    def make(d: Path) -> Built:
        img, dir_offset, _ = with_bitmap(d)
        for name, value in fields.items():
            off, fmt = BITMAP_ENTRY_FIELDS[name]
            v = value(dir_offset) if callable(value) else value
            ed.write_bytes(img, dir_offset + off, struct.pack(fmt, v))
        return built(img)
    return make


def bitmap_count(n: int) -> Callable[[Path], Built]:
    """The bitmaps extension claims n bitmaps; the directory holds one."""
    def make(d: Path) -> Built:
        img, _, _ = with_bitmap(d)
        exts = [(t, struct.pack(">I", n) + data[4:] if t == BITMAPS_EXT else data) for t, data in ed.read_extensions(img)]
        ed.write_extensions(img, exts)
        return built(img)
    return make


def bitmap_table_entry(value: int, flags: int | None = None) -> Callable[[Path], Built]:
    """Entry 0 of b0's bitmap table set to value (and the entry's flags, when given)."""
    def make(d: Path) -> Built:
        img, dir_offset, table = with_bitmap(d)
        ed.write_u64(img, table, value)
        if flags is not None:
            ed.write_bytes(img, dir_offset + 12, struct.pack(">I", flags))
        return built(img)
    return make


def extension_length_overflow(d: Path) -> Built:
    """An extension whose length field runs far past the header cluster."""
    img = plain(d)
    start = ed.get_field(img, "header_length")
    ed.write_bytes(img, start, struct.pack(">II", 0x12345678, 0x7FFFFFF0))
    return built(img)


def luks(d: Path) -> Built:
    img = d / "img.qcow2"
    # qemu 7.2's PBKDF benchmark sometimes measures no user CPU time for its
    # first round ("Unable to get accurate CPU usage"): 1 in 5 attempts on an
    # idle machine here, and up to half on a busy one, independently. A failed
    # attempt ends in milliseconds, so try until it works.
    attempts = 25
    for attempt in range(attempts):
        try:
            run("qemu-img", "create", "-q", "--object", "secret,id=sec0,data=hostile-pass", "-f", "qcow2",
                "-o", "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=200", img, "16M")
            break
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    return built(img)


def backing_pair(d: Path) -> tuple[Path, Path]:
    base = plain(d, "base.qcow2")
    top = d / "top.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", "-b", base.name,
        "-F", "qcow2", top, "16M")
    return base, top


def backing_field(**fields) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        base, top = backing_pair(d)
        for name, value in fields.items():
            ed.set_field(top, name, value)
        return built(top, base)
    return make


def backing_format_too_long(d: Path) -> Built:
    base, top = backing_pair(d)
    ed.write_bytes(top, 2048, base.name.encode())  # move the name out of the way
    ed.set_field(top, "backing_file_offset", 2048)
    exts = [(t, data) for t, data in ed.read_extensions(top) if t != 0xE2792ACA]
    ed.write_extensions(top, [*exts, (0xE2792ACA, b"q" * 64)])
    return built(top, base)


def backing_loop(d: Path) -> Built:
    a, b = d / "a.qcow2", d / "b.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", a, "16M")
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", a.name, "-F", "qcow2", b, "16M")
    run("qemu-img", "rebase", "-u", "-f", "qcow2", "-b", b.name, "-F", "qcow2", a)
    return built(b, a)


def backing_self(d: Path) -> Built:
    img = d / "self.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", img, "16M")
    run("qemu-img", "rebase", "-u", "-f", "qcow2", "-b", img.name, "-F", "qcow2", img)
    return built(img)


def backing_missing(d: Path) -> Built:
    img = d / "img.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", "missing-base.qcow2", "-F", "qcow2", img, "16M")
    return built(img)


def foreign_backing(fmt: str, create_opts: str = "", record_format: bool = True) -> Callable[[Path], Built]:
    """A qcow2 overlay over a backing file of another format (qcowfs reads none yet).
    record_format=False drops the backing format extension, so the format is probed."""
    def make(d: Path) -> Built:
        base, top = d / f"base.{fmt}", d / "top.qcow2"
        opts = ["-o", create_opts] if create_opts else []
        run("qemu-img", "create", "-q", "-f", fmt, *opts, base, "16M")
        run("qemu-img", "create", "-q", "-f", "qcow2", "-b", base.name, "-F", fmt, top, "16M")
        if not record_format:
            ed.write_extensions(top, [(t, data) for t, data in ed.read_extensions(top) if t != 0xE2792ACA])
        return built(top, base)
    return make


def data_file_missing(d: Path) -> Built:
    img = d / "img.qcow2"
    # qemu-img resolves a relative data_file name against its cwd
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "data_file=img.data", img.name, "16M", cwd=d)
    qemu_io(img, "write -q -P 12 0 64k")
    (d / "img.data").unlink()
    return built(img)


def snapshot_patch(field_off: int, size: int, value: int) -> Callable[[Path], Built]:
    writer = {2: ed.write_u16, 4: ed.write_u32, 8: ed.write_u64}[size]

    def make(d: Path) -> Built:
        img = with_snapshot(d)
        writer(img, ed.first_snapshot_offset(img) + field_off, value)
        return built(img)
    return make


def snapshot_name_overflows(d: Path) -> Built:
    """The only snapshot entry moved to the last cluster, its name 64 KiB long."""
    img = with_snapshot(d)
    src = ed.first_snapshot_offset(img)
    with open(img, "rb") as f:
        f.seek(src)
        entry = f.read(ed.cluster_size(img))
    last = (os.path.getsize(img) - 1) // ed.cluster_size(img) * ed.cluster_size(img)
    ed.write_bytes(img, last, entry[: os.path.getsize(img) - last])
    ed.set_field(img, "snapshots_offset", last)
    ed.write_u16(img, last + 14, 0xFFFF)
    return built(img)


def snapshot_count(d: Path) -> Built:
    img = with_snapshot(d)
    ed.set_field(img, "nb_snapshots", 4000)
    return built(img)


# L1 and L2 entries of the plain image (4 KiB clusters, 2 MiB per L2 table).


def l1_patch(guest: int, value: Callable[[Path, int], int]) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = plain(d)
        raw = to_raw(img, d / "pristine.raw")
        ed.set_l1_entry(img, guest, value(img, ed.read_u64(img, ed.l1_entry_offset(img, guest))))
        return Built(img, [img], raw)
    return make


def l2_patch(base: Callable[[Path], Path], guest: int,
             value: Callable[[Path, int], int]) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = base(d)
        raw = to_raw(img, d / "pristine.raw")
        ed.set_l2_entry(img, guest, value(img, ed.get_l2_entry(img, guest)))
        return Built(img, [img], raw)
    return make


def bitmap_patch(guest: int, bitmap: int, entry: Callable[[Path, int], int] | None = None):
    def make(d: Path) -> Built:
        img = extended(d)
        raw = to_raw(img, d / "pristine.raw")
        if entry is not None:
            ed.set_l2_entry(img, guest, entry(img, ed.get_l2_entry(img, guest)))
        ed.set_l2_bitmap(img, guest, bitmap)
        return Built(img, [img], raw)
    return make


def past_eof(img: Path, entry: int) -> int:
    return (entry & ~ed.L2_OFFSET_MASK) | (os.path.getsize(img) + 64 * MiB)


def metadata_offset(field_name: str) -> Callable[[Path, int], int]:
    def value(img: Path, entry: int) -> int:
        return (entry & ~ed.L2_OFFSET_MASK) | ed.get_field(img, field_name)
    return value


def refcount_patch(value: Callable[[Path, int], int]) -> Callable[[Path], Built]:
    def make(d: Path) -> Built:
        img = plain(d)
        off = ed.refcount_table_entry_offset(img, 0)
        ed.write_u64(img, off, value(img, ed.read_u64(img, off)))
        return built(img)
    return make


def compressed_sectors_overflow(img: Path, entry: int) -> int:
    host, _ = ed.compressed_fields(img, entry)
    return ed.compressed_entry(img, host, (1 << (ed.cluster_bits(img) - 8)) - 1)


def compressed_host(where: Callable[[Path], int]) -> Callable[[Path, int], int]:
    def value(img: Path, entry: int) -> int:
        _, sectors = ed.compressed_fields(img, entry)
        return ed.compressed_entry(img, where(img), sectors)
    return value


def plain_data_host(img: Path) -> int:
    """Host offset of the uncompressed cluster at guest 1M (holds 0x07 bytes, not a stream)."""
    return ed.get_l2_entry(img, 1 * MiB) & ed.L2_OFFSET_MASK


PLAIN_GOOD = ((4 * MiB, 64 * KiB), (8 * MiB, 64 * KiB), (12 * MiB, 1 * MiB), (14 * MiB, 64 * KiB))


def eio_first_l2(bad_len: int) -> Eio:
    return Eio(bad=((0, bad_len), (bad_len // 2, 4 * KiB)), good=PLAIN_GOOD)


ONE_CLUSTER_BAD = Eio(bad=((64 * KiB, 4 * KiB), (60 * KiB, 12 * KiB)),
                      good=((0, 64 * KiB), (68 * KiB, 956 * KiB), *PLAIN_GOOD))
COMPRESSED_BAD = Eio(bad=((0, 64 * KiB), (512, 512)), good=((64 * KiB, 64 * KiB), (1 * MiB, 64 * KiB)))
EXTENDED_BAD = Eio(bad=((1 * MiB, 2 * KiB), (1 * MiB, 64 * KiB)),
                   good=((0, 64 * KiB), (2 * MiB, 64 * KiB), (3 * MiB, 64 * KiB)))

CASES: dict[str, Case] = {
    # ---- header: refused at open ----
    "truncated_header_50_bytes": Case(truncated(50), Refused(r"too small|truncat|header"),
                                      "file shorter than a v2 header"),
    "truncated_header_v3_90_bytes": Case(truncated(90), Refused(r"truncat|header|small"),
                                         "v3 header cut before header_length"),
    "truncated_after_header_cluster": Case(truncated(4096), Refused(r"l1|refcount|outside|truncat|end of the file"),
                                           "header intact, every table beyond EOF"),
    "cluster_bits_8": Case(header_fields(cluster_bits=8), Refused(r"cluster"), "below 512 B"),
    "cluster_bits_22": Case(header_fields(cluster_bits=22), Refused(r"cluster"), "above 2 MiB"),
    "cluster_bits_63": Case(header_fields(cluster_bits=63), Refused(r"cluster"), "shift overflow bait"),
    "size_2_pow_63": Case(header_fields(size=1 << 63), Refused(r"size|l1"), "virtual size overflow"),
    "l1_size_absurd": Case(header_fields(l1_size=0x7FFFFFFF), Refused(r"l1"), "L1 allocation bomb"),
    "l1_size_too_small": Case(header_fields(l1_size=1), Refused(r"l1"), "L1 too small for the size"),
    "refcount_table_clusters_absurd": Case(header_fields(refcount_table_clusters=0xFFFFFFFF),
                                           Refused(r"refcount"), "refcount table allocation bomb"),
    "refcount_table_clusters_zero": Case(header_fields(refcount_table_clusters=0), Refused(r"refcount"),
                                         "no refcount table"),
    "refcount_order_7": Case(header_fields(refcount_order=7), Refused(r"refcount"), "128-bit refcounts"),
    "version_1": Case(header_fields(version=1), Refused(r"version"), "qcow v1"),
    "version_4": Case(header_fields(version=4), Refused(r"version"), "future version"),
    "header_length_odd": Case(header_fields(header_length=105), Refused(r"header_length|header"),
                              "not a multiple of 8"),
    "header_length_beyond_cluster": Case(header_fields(header_length=8192), Refused(r"header_length|header"),
                                         "header longer than its cluster"),
    "l1_overlaps_header": Case(header_fields(l1_table_offset=0), Refused(r"l1|header"), "L1 at offset 0"),
    "l1_unaligned": Case(header_fields(l1_table_offset=0x3001), Refused(r"l1|align"), "L1 offset unaligned"),
    "l1_beyond_eof": Case(header_fields(l1_table_offset=1 << 40), Refused(r"l1"), "L1 past the end"),
    "l1_overlaps_refcount_table": Case(
        header_fields_from(lambda img: {"l1_table_offset": ed.get_field(img, "refcount_table_offset")}),
        Refused(r"overlap|l1|refcount"), "two tables in one cluster"),
    "refcount_table_beyond_eof": Case(header_fields(refcount_table_offset=1 << 40), Refused(r"refcount"),
                                      "refcount table past the end"),
    "refcount_table_in_header": Case(header_fields(refcount_table_offset=0), Refused(r"refcount|header"),
                                     "refcount table at offset 0"),
    "unknown_incompatible_bit": Case(incompatible_bit(20), Refused(r"incompatible|feature|unsupported"),
                                     "bit 20 unknown"),
    "named_incompatible_feature": Case(incompatible_bit(21, "frobnicator"), Refused(r"frobnicator"),
                                       "unknown bit with a feature-table name"),
    "data_file_bit_without_name": Case(incompatible_bit(2), Refused(r"data file"),
                                       "external data bit, no data file extension"),
    "raw_data_bit_without_data_file": Case(header_fields(autoclear_features=2), Refused(r"raw|data file"),
                                           "data_file_raw autoclear bit alone"),
    "extended_l2_small_clusters": Case(
        header_fields_from(lambda img: {"incompatible_features": ed.INCOMPAT_EXTENDED_L2}),
        Refused(r"extended|cluster"), "extended L2 needs 16 KiB clusters"),
    "zstd_bit_without_type": Case(incompatible_bit(3), Refused(r"compression"),
                                  "compression-type bit with zlib"),
    "extension_length_overflow": Case(extension_length_overflow, Refused(r"extension"),
                                      "extension length 2 GiB"),
    "bitmaps_extension_garbage": Case(extension(0x23852875, b"\xff" * 24, autoclear=1), Refused(r"bitmap"),
                                      "bitmap directory bomb (autoclear bit set: QEMU ignores it otherwise)"),
    # persistent bitmaps: QEMU refuses to open these (block/qcow2-bitmap.c), qcowfs too
    "bitmap_granularity_too_large": Case(bitmap_entry(granularity_bits=40), Refused(r"constraints"),
                                         "granularity 2^40 (QEMU's maximum is 2^31)"),
    "bitmap_name_past_directory": Case(bitmap_entry(name_size=0xFFFF), Refused(r"Broken bitmap directory"),
                                       "entry name runs past the directory"),
    "bitmap_count_mismatch": Case(bitmap_count(2), Refused(r"Less bitmaps"), "extension counts 2, directory has 1"),
    "bitmap_table_entry_reserved": Case(bitmap_table_entry(0x2), Refused(r"entry 0"),
                                        "bitmap table entry with a reserved bit"),
    "bitmap_table_size_mismatch": Case(bitmap_entry(table_size=3), Refused(r"Could not read bitmap"),
                                       "table longer than the disk needs"),
    "bitmap_table_on_directory": Case(bitmap_entry(table_offset=lambda dir_offset: dir_offset), Refused(r"overlaps|outside the file"),
                                      "bitmap table placed on the directory"),
    "bitmap_in_use_bad_table": Case(bitmap_table_entry(0x2, flags=3), Readable(),
                                    "an in-use bitmap's table is never read (QEMU skips it too)"),
    "encryption_aes": Case(header_fields(crypt_method=1), Refused(r"encrypt"), "legacy AES"),
    "encryption_luks": Case(luks, Refused(r"encrypt"), "real LUKS image from qemu-img"),
    "encryption_unknown_method": Case(header_fields(crypt_method=7), Refused(r"encrypt|crypt"),
                                      "crypt_method 7"),
    # ---- chains and files ----
    "backing_name_too_long": Case(backing_field(backing_file_size=5000), Refused(r"backing"),
                                  "backing name of 5000 bytes"),
    "backing_name_outside_header": Case(backing_field(backing_file_offset=1 << 30), Refused(r"backing"),
                                        "backing name offset past the header cluster"),
    "backing_format_too_long": Case(backing_format_too_long, Refused(r"backing format|format"),
                                    "backing format name of 64 bytes"),
    "backing_loop_a_b_a": Case(backing_loop, Refused(r"loop|circular|cycle"), "a -> b -> a"),
    "backing_self": Case(backing_self, Refused(r"loop|circular|cycle"), "image backs itself"),
    "backing_missing": Case(backing_missing, Refused(r"backing"), "backing file does not exist"),
    "data_file_missing": Case(data_file_missing, Refused(r"data file"), "external data file deleted"),
    # ---- snapshot table ----
    "snapshot_count_overflow": Case(snapshot_count, Refused(r"snapshot"), "4000 entries, 1 present"),
    "snapshot_table_beyond_eof": Case(header_fields(with_snapshot, snapshots_offset=1 << 40),
                                      Refused(r"snapshot"), "table offset past the end"),
    "snapshot_extra_data_huge": Case(snapshot_patch(36, 4, 0xFFFFFFFF), Refused(r"snapshot"),
                                     "extra_data_size 4 GiB"),
    "snapshot_name_overflows": Case(snapshot_name_overflows, Refused(r"snapshot"),
                                    "name runs past the file"),
    "snapshot_l1_size_absurd": Case(snapshot_patch(8, 4, 0x7FFFFFFF), Refused(r"snapshot|l1"),
                                    "snapshot L1 of 2^31 entries"),
    # ---- L1 entries: EIO on the L2 table's range, the rest readable ----
    "l1_entry_beyond_eof": Case(l1_patch(0, past_eof), eio_first_l2(2 * MiB), "L2 table past the end"),
    "l1_entry_unaligned": Case(l1_patch(0, lambda img, e: e + 0x200), eio_first_l2(2 * MiB),
                               "L2 table offset not cluster aligned"),
    "l1_entry_reserved_bits": Case(l1_patch(0, lambda img, e: e | (1 << 56)), eio_first_l2(2 * MiB),
                                   "reserved L1 bits"),
    "l1_entry_into_l1_table": Case(l1_patch(0, lambda img, e: (e & ~ed.L1_OFFSET_MASK)
                                            | ed.get_field(img, "l1_table_offset")),
                                   Readable(), "L1 table read as an L2 table (QEMU reads it too)"),
    # ---- L2 entries: EIO on one cluster ----
    "l2_entry_beyond_eof": Case(l2_patch(plain, 64 * KiB, past_eof), ONE_CLUSTER_BAD, "data past the end"),
    "l2_entry_unaligned": Case(l2_patch(plain, 64 * KiB, lambda img, e: e + 0x200), ONE_CLUSTER_BAD,
                               "data offset unaligned"),
    "l2_entry_reserved_bits": Case(l2_patch(plain, 64 * KiB, lambda img, e: e | (1 << 57)), ONE_CLUSTER_BAD,
                                   "reserved L2 bits"),
    "l2_entry_into_refcount_table": Case(l2_patch(plain, 64 * KiB, metadata_offset("refcount_table_offset")),
                                         Readable(), "data cluster aliasing the refcount table"),
    "compressed_size_overflows_file": Case(l2_patch(compressed, 0, compressed_sectors_overflow), COMPRESSED_BAD,
                                           "compressed stream runs past the end"),
    "compressed_offset_beyond_eof": Case(l2_patch(compressed, 0, compressed_host(
        lambda img: os.path.getsize(img) + 1 * MiB + 17)), COMPRESSED_BAD, "compressed stream past the end"),
    "compressed_into_header": Case(l2_patch(compressed, 0, compressed_host(lambda img: 100)), COMPRESSED_BAD,
                                   "compressed stream inside the header"),
    "compressed_garbage_stream": Case(l2_patch(compressed, 0, compressed_host(plain_data_host)), COMPRESSED_BAD,
                                      "compressed descriptor onto plain data"),
    "subcluster_both_bits": Case(bitmap_patch(1 * MiB, 0x1_00000001), EXTENDED_BAD,
                                 "subcluster 0 allocated and zero"),
    "subcluster_alloc_without_cluster": Case(bitmap_patch(1 * MiB, 0x3, entry=lambda img, e: 0), EXTENDED_BAD,
                                             "allocated subclusters in an unallocated cluster"),
    "compressed_with_subcluster_bitmap": Case(bitmap_patch(1 * MiB, 0x1, entry=lambda img, e: ed.compressed_entry(
        img, plain_data_host_ext(img), 0)), EXTENDED_BAD, "compressed entry with a bitmap"),
    # ---- refcount structures: harmless to readers ----
    "reftable_entry_beyond_eof": Case(refcount_patch(lambda img, e: 1 << 45), Readable(),
                                      "refcount block past the end"),
    "reftable_entry_unaligned": Case(refcount_patch(lambda img, e: e + 0x200), Readable(),
                                     "refcount block unaligned"),
    "reftable_entry_into_l1": Case(refcount_patch(lambda img, e: ed.get_field(img, "l1_table_offset")),
                                   Readable(), "refcount block aliasing the L1 table"),
}


def load_format_cases() -> None:
    """Adds the cases of the other formats: each tests/qcowfs_testlib/hostile_FMT.py has
    `cases(h)`, given this module (its Case, outcomes and tools), returning a
    dict of cases whose names start with FMT_."""
    import importlib
    here = Path(__file__).resolve().parent
    this = sys.modules[__name__]
    for path in sorted(here.glob("hostile_*.py")):
        module = importlib.import_module(f"qcowfs_testlib.{path.stem}")
        for name, case in module.cases(this).items():
            if name in CASES:
                raise ValueError(f"{path.name}: case {name} is defined twice")
            CASES[name] = case


def plain_data_host_ext(img: Path) -> int:
    """Host offset of the full data cluster at guest 0 of the extended image."""
    return ed.get_l2_entry(img, 0) & ed.L2_OFFSET_MASK


load_format_cases()


def build(name: str, directory: Path) -> Built:
    directory.mkdir(parents=True, exist_ok=True)
    return CASES[name].make(directory)


def manifest_entry(name: str, b: Built) -> dict:
    """What a non-Python consumer needs to check one case (tests/unit/image/hostile_corpus_test.cc)."""
    o = CASES[name].outcome
    entry = {"name": name, "image": str(b.image), "note": CASES[name].note}
    if isinstance(o, Refused):
        entry.update(outcome="refused", pattern=o.pattern)
    elif isinstance(o, Eio):
        entry.update(outcome="eio", bad=[list(r) for r in o.bad], good=[list(r) for r in o.good],
                     pristine_raw=str(b.pristine_raw))
    else:
        raw = to_raw(b.image, b.image.with_suffix(".qemu.raw"), b.extra.get("format", "qcow2"))
        entry.update(outcome="readable", reference_raw=str(raw))
    return entry


def main(argv: list[str]) -> int:
    """OUTDIR [CASE...]: builds the cases and writes OUTDIR/manifest.json."""
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0])
    entries = []
    for name in argv[1:] or list(CASES):
        d = out / name
        shutil.rmtree(d, ignore_errors=True)
        b = build(name, d)
        entries.append(manifest_entry(name, b))
        print(f"{name}: {b.image} ({CASES[name].note})")
    (out / "manifest.json").write_text(json.dumps(entries, indent=1))
    (out / "manifest.tsv").write_text("".join(tsv_line(e) + "\n" for e in entries))
    return 0


def tsv_line(e: dict) -> str:
    """One tab-separated line per case, for C++ readers:
    refused NAME IMAGE PATTERN | eio NAME IMAGE PRISTINE_RAW BAD GOOD | readable NAME IMAGE REFERENCE_RAW
    where BAD and GOOD are comma-separated OFFSET:LENGTH lists."""
    def ranges(rs):
        return ",".join(f"{o}:{n}" for o, n in rs)
    if e["outcome"] == "refused":
        fields = [e["pattern"]]
    elif e["outcome"] == "eio":
        fields = [e["pristine_raw"], ranges(e["bad"]), ranges(e["good"])]
    else:
        fields = [e["reference_raw"]]
    return "\t".join([e["outcome"], e["name"], e["image"], *fields])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
