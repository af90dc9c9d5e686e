#!/usr/bin/env python3
"""Builds the qcow2 images of the read test matrix (issue 3) with qemu-img and qemu-io.

Each case is a function that builds one image (and its backing/data files)
in an empty directory and returns an Image. The content is deterministic
(seeded by the case name) and deliberately varied: constant patterns (-P),
position-unique random and text data (write -s FILE), byte-granular partial
clusters, writes straddling L2-table and L2-slice boundaries, zeroed ranges.

Usage: PYTHONPATH=tests python3 -m qcowfs_testlib.qcow2_matrix OUTDIR [CASE...]   builds the cases (all by default)
       qcow2_matrix.py --list             lists the case names
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


from qcowfs_testlib import helpers
from qcowfs_testlib import qcow2_meta

KiB, MiB = 1 << 10, 1 << 20
L2_SLICE_BYTES = 4 * KiB  # qcowfs's L2 cache slice: a slice boundary is worth crossing


@dataclass
class Image:
    path: Path                                        # the image to mount
    files: list[Path] = field(default_factory=list)   # every host file it reads
    snapshots: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------
# Writing varied content with qemu-io


class Writer:
    """Collects qemu-io commands and runs them in one qemu-io process."""

    def __init__(self, workdir: Path, seed: str, max_len: int):
        self.rng = random.Random(seed)
        self.cmds: list[str] = []
        self.next_pattern = 1
        self.sources = make_sources(workdir, self.rng, max_len)
        self.next_source = 0

    def pattern(self, off: int, length: int) -> None:
        """Fills [off, off+length) with one byte value, different for each call."""
        self.cmds.append(f"write -q -P {self.next_pattern} {off} {length}")
        self.next_pattern = self.next_pattern % 254 + 1

    def unique(self, off: int, length: int) -> None:
        """Fills [off, off+length) with position-unique bytes (random or text)."""
        src = self.sources[self.next_source % len(self.sources)]
        self.next_source += 1
        self.cmds.append(f"write -q -s {src} {off} {length}")

    def zero(self, off: int, length: int, unmap: bool = False) -> None:
        self.cmds.append(f"write -q -z {'-u ' if unmap else ''}{off} {length}")

    def either(self, off: int, length: int) -> None:
        (self.unique if self.rng.random() < 0.6 else self.pattern)(off, length)

    def run(self, image: Path, fmt: str | None = None) -> None:
        # qemu-io passes each -c through argv; split long lists to stay far from limits.
        for i in range(0, len(self.cmds), 200):
            helpers.qemu_io(image, *self.cmds[i:i + 200], fmt=fmt)
        self.cmds.clear()


def make_sources(workdir: Path, rng: random.Random, max_len: int) -> list[Path]:
    """Three source files for write -s: two random (incompressible), one text."""
    paths = []
    for i in range(2):
        p = workdir / f".src-random-{i}.bin"
        p.write_bytes(rng.randbytes(max_len))
        paths.append(p)
    text = bytearray()
    line = 0
    while len(text) < max_len:
        text += f"qcowfs test line {line:09d} seed {rng.randrange(1 << 30):010d}\n".encode()
        line += 1
    p = workdir / ".src-text.txt"
    p.write_bytes(bytes(text[:max_len]))
    paths.append(p)
    return paths


def scatter(w: Writer, size: int, cluster: int, l2_entry_bytes: int = 8,
            count: int = 24, zeroes: bool = True) -> None:
    """Varied writes over a disk of size bytes with the given cluster size."""
    rng = w.rng
    lengths = [1, 511, 4097, cluster // 3 + 1, cluster, 2 * cluster + 123, 3 * cluster]
    lengths = [n for n in lengths if 0 < n < size // 4]
    w.unique(0, cluster // 2 + 7)
    for _ in range(count):
        length = rng.choice(lengths)
        off = rng.randrange(0, size - length)
        if rng.random() < 0.4:
            off -= off % cluster
        w.either(off, length)
    l2_cover = cluster // l2_entry_bytes * cluster
    slice_cover = L2_SLICE_BYTES // l2_entry_bytes * cluster
    for boundary in boundaries(size, l2_cover, 3) + boundaries(size, slice_cover, 3):
        w.unique(boundary - cluster - 100, 2 * cluster + 200)
    w.pattern(size - cluster - 33, cluster + 33)
    if zeroes:
        z = rng.randrange(size // 2, size - 4 * cluster)
        z -= z % cluster
        w.zero(z, 2 * cluster)                       # aligned: zero clusters
        w.zero(z + 2 * cluster + 77, cluster // 2)   # partial: written zeros


def boundaries(size: int, step: int, limit: int) -> list[int]:
    return [b for b in range(step, size, step)][:limit]


def writer_for(out: Path, name: str, cluster: int) -> Writer:
    return Writer(out, name, max(3 * cluster + 4 * KiB, 256 * KiB))


def create(path: Path, size: int, *opts: str, backing: str | None = None,
           backing_fmt: str | None = None) -> Path:
    args = ["create", "-q", "-f", "qcow2"]
    if opts:
        args += ["-o", ",".join(opts)]
    if backing is not None:
        args += ["-b", backing, "-F", backing_fmt or "qcow2"]
    helpers.qemu_img(*args, path, str(size))
    return path


# --------------------------------------------------------------------------
# Cases


def plain(out: Path, name: str, size: int, cluster: int, *opts: str) -> Image:
    img = create(out / f"{name}.qcow2", size, f"cluster_size={cluster}", *opts)
    w = writer_for(out, name, cluster)
    scatter(w, size, cluster)
    w.run(img)
    return Image(img, [img])


def case_cluster_512(out: Path) -> Image:
    return plain(out, "cluster_512", 6 * MiB, 512)


def case_cluster_4k(out: Path) -> Image:
    return plain(out, "cluster_4k", 40 * MiB, 4 * KiB)


def case_cluster_64k(out: Path) -> Image:
    # 600 MiB so writes straddle the first L2 table's end at 512 MiB.
    return plain(out, "cluster_64k", 600 * MiB, 64 * KiB)


def case_cluster_2m(out: Path) -> Image:
    return plain(out, "cluster_2m", 96 * MiB, 2 * MiB)


def case_refcount_bits_1(out: Path) -> Image:
    return plain(out, "refcount1", 24 * MiB, 4 * KiB, "refcount_bits=1")


def case_refcount_bits_64(out: Path) -> Image:
    return plain(out, "refcount64", 48 * MiB, 64 * KiB, "refcount_bits=64")


def case_v2_compat_0_10(out: Path) -> Image:
    return plain(out, "v2", 48 * MiB, 64 * KiB, "compat=0.10")


def compressed(out: Path, name: str, ctype: str, cluster: int, size: int,
               overwrite: bool = False) -> Image:
    """A varied source converted with -c; optionally written again afterwards."""
    src = create(out / f"{name}-src.qcow2", size, "cluster_size=64k")
    w = writer_for(out, name, max(cluster, 64 * KiB))
    scatter(w, size, cluster, count=32)
    w.run(src)
    img = out / f"{name}.qcow2"
    helpers.qemu_img("convert", "-c", "-f", "qcow2", "-O", "qcow2", "-o",
                     f"cluster_size={cluster},compression_type={ctype}", src, img)
    src.unlink()
    report = helpers.qemu_img_check(img)
    assert report.get("compressed-clusters", 0) > 0, f"{img}: no compressed clusters made"
    if overwrite:  # partial writes into compressed clusters: decompress-and-rewrite paths
        w2 = Writer(out, name + "-overwrite", 256 * KiB)
        for _ in range(12):
            off = w2.rng.randrange(0, size - cluster)
            w2.either(off, w2.rng.choice([1, 700, cluster // 2 + 1]))
        w2.run(img)
    return Image(img, [img])


def case_compressed_zlib_64k(out: Path) -> Image:
    return compressed(out, "zlib64k", "zlib", 64 * KiB, 32 * MiB)


def case_compressed_zstd_64k(out: Path) -> Image:
    return compressed(out, "zstd64k", "zstd", 64 * KiB, 32 * MiB)


def case_compressed_zlib_4k(out: Path) -> Image:
    return compressed(out, "zlib4k", "zlib", 4 * KiB, 16 * MiB)


def case_compressed_zstd_2m(out: Path) -> Image:
    return compressed(out, "zstd2m", "zstd", 2 * MiB, 48 * MiB)


def case_compressed_zstd_then_written(out: Path) -> Image:
    return compressed(out, "zstdw", "zstd", 64 * KiB, 32 * MiB, overwrite=True)


def case_compressed_zlib_written_by_qemu_io(out: Path) -> Image:
    """Compressed clusters written one by one with `write -c` (qemu-io's own path)."""
    cluster, size = 64 * KiB, 16 * MiB
    img = create(out / "wc.qcow2", size, f"cluster_size={cluster}")
    w = writer_for(out, "wc", cluster)
    for n, c in enumerate(range(0, 40, 3)):
        src = w.sources[2 if n % 3 else n % 2]   # mostly text: it compresses
        w.cmds.append(f"write -q -c -s {src} {c * cluster} {cluster}")
    w.pattern(3 * cluster + 100, 200)   # overwrite part of a compressed cluster
    w.run(img)
    report = helpers.qemu_img_check(img)
    assert report.get("compressed-clusters", 0) > 0, f"{img}: no compressed clusters made"
    return Image(img, [img])


def extended_l2(out: Path, name: str, cluster: int, size: int, with_backing: bool) -> Image:
    """Subclusters: partial subcluster writes, zeroed subclusters, backing showing through."""
    sub = cluster // 32
    files = []
    backing = None
    if with_backing:
        base = create(out / f"{name}-base.qcow2", size, "cluster_size=64k")
        wb = writer_for(out, name + "-base", cluster)
        wb.pattern(0, size // 2)
        wb.unique(size // 2, size // 4)
        wb.run(base)
        backing, files = base.name, [base]
    img = create(out / f"{name}.qcow2", size, f"cluster_size={cluster}", "extended_l2=on",
                 backing=backing)
    w = writer_for(out, name, cluster)
    rng = w.rng
    for i in range(24):
        c = rng.randrange(0, size // cluster - 1) * cluster
        s = rng.randrange(0, 32)
        kind = i % 4
        if kind == 0:
            w.either(c + s * sub + 100, sub // 2)           # inside one subcluster
        elif kind == 1:
            w.either(c + s * sub - 7 if s else c, sub + 14)  # straddles subclusters
        elif kind == 2:
            w.zero(c + s * sub, sub * rng.randrange(1, 4))   # zero subclusters
        else:
            w.either(c + s * sub, sub * rng.randrange(1, 5))  # whole subclusters
    w.zero(2 * cluster, cluster)                    # a fully zero cluster
    w.zero(4 * cluster, cluster, unmap=True)
    scatter(w, size, cluster, l2_entry_bytes=16, count=8, zeroes=False)
    w.run(img)
    return Image(img, [img, *files])


def case_extended_l2_64k_backing(out: Path) -> Image:
    return extended_l2(out, "extl2-64k", 64 * KiB, 32 * MiB, True)


def case_extended_l2_16k(out: Path) -> Image:
    return extended_l2(out, "extl2-16k", 16 * KiB, 40 * MiB, False)


def case_backing_chain_raw_base(out: Path) -> Image:
    """top.qcow2 -> ../chain/l2.qcow2 -> l1.qcow2 -> ../base/base.raw (relative names).

    Sizes vary along the chain (base 24 MiB < l1 40 MiB > l2 32 MiB < top 48 MiB):
    data l1 holds past l2's end must not show through, and reads past a short
    backing file are zeros.
    """
    for d in ("base", "chain", "top"):
        (out / d).mkdir()
    base = out / "base" / "base.raw"
    write_sparse_raw(base, 24 * MiB, random.Random("base"))
    l1 = create(out / "chain" / "l1.qcow2", 40 * MiB, "cluster_size=64k",
                backing="../base/base.raw", backing_fmt="raw")
    w = writer_for(out, "l1", 64 * KiB)
    scatter(w, 40 * MiB, 64 * KiB, count=16)
    w.unique(34 * MiB, 2 * MiB)  # beyond l2's size: hidden from top
    w.run(l1)
    l2 = create(out / "chain" / "l2.qcow2", 32 * MiB, "cluster_size=4k",
                backing="l1.qcow2")
    w = writer_for(out, "l2", 4 * KiB)
    scatter(w, 32 * MiB, 4 * KiB, count=16)
    w.run(l2)
    top = create(out / "top" / "top.qcow2", 48 * MiB, "cluster_size=64k",
                 backing="../chain/l2.qcow2")
    w = writer_for(out, "top", 64 * KiB)
    scatter(w, 48 * MiB, 64 * KiB, count=12)
    w.zero(1 * MiB, 256 * KiB)               # zero clusters hiding backing data
    w.zero(3 * MiB + 4096, 64 * KiB, unmap=True)
    w.run(top)
    return Image(top, [top, l2, l1, base])


def write_sparse_raw(path: Path, size: int, rng: random.Random) -> None:
    """A sparse raw file: random runs and pattern runs with holes between them."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off in range(0, size, 3 * MiB):
            length = rng.randrange(1, 1 * MiB)
            f.seek(off + rng.randrange(0, 1 * MiB))
            f.write(rng.randbytes(length) if rng.random() < 0.5 else bytes([off % 251 + 1]) * length)


def case_backing_raw_looks_like_qcow2(out: Path) -> Image:
    """A raw backing file whose guest wrote a qcow2 image into it: the overlay's
    recorded backing format (raw) must win over the magic at offset 0."""
    inner = create(out / "inner.qcow2", 8 * MiB, "cluster_size=4k")
    helpers.qemu_io(inner, "write -q -P 0x5a 0 1M")
    base = out / "guest-disk.raw"
    with open(base, "wb") as f:
        f.write(inner.read_bytes())
        f.truncate(16 * MiB)
    inner.unlink()
    img = create(out / "over.qcow2", 16 * MiB, "cluster_size=64k",
                 backing=base.name, backing_fmt="raw")
    w = writer_for(out, "over", 64 * KiB)
    w.unique(8 * MiB + 300, 200 * KiB)
    w.run(img)
    return Image(img, [img, base])


def external_data(out: Path, name: str, raw: bool) -> Image:
    data = out / f"{name}.data"
    opts = ["cluster_size=64k", f"data_file={data}"]
    if raw:
        opts.append("data_file_raw=on")
    img = create(out / f"{name}.qcow2", 32 * MiB, *opts)
    w = writer_for(out, name, 64 * KiB)
    scatter(w, 32 * MiB, 64 * KiB)
    w.run(img)
    return Image(img, [img, data])


def case_external_data_file(out: Path) -> Image:
    return external_data(out, "extdata", False)


def case_external_data_file_raw(out: Path) -> Image:
    return external_data(out, "extdataraw", True)


def case_zero_clusters(out: Path) -> Image:
    """write -z with and without -u over data, over holes and over a backing file."""
    cluster, size = 64 * KiB, 32 * MiB
    base = create(out / "zero-base.qcow2", size, "cluster_size=64k")
    wb = writer_for(out, "zero-base", cluster)
    wb.unique(0, 8 * MiB)
    wb.pattern(8 * MiB, 8 * MiB)
    wb.run(base)
    img = create(out / "zero.qcow2", size, "cluster_size=64k", backing=base.name)
    w = writer_for(out, "zero", cluster)
    w.unique(0, 4 * MiB)
    w.unique(20 * MiB, 4 * MiB)
    w.zero(1 * MiB, 512 * KiB)                  # ZERO_ALLOC over own data
    w.zero(2 * MiB, 512 * KiB, unmap=True)      # ZERO_PLAIN over own data
    w.zero(6 * MiB, 1 * MiB)                    # zero over backing data
    w.zero(10 * MiB, 1 * MiB, unmap=True)
    w.zero(17 * MiB, 2 * MiB)                   # zero where nothing is allocated
    w.zero(21 * MiB + 1000, 70 * KiB)           # unaligned: partial zero writes
    w.zero(22 * MiB + 3 * cluster, 5 * cluster, unmap=True)
    w.pattern(1 * MiB + cluster, 100)           # data again inside a zeroed range
    w.run(img)
    return Image(img, [img, base])


def preallocated(out: Path, name: str, mode: str) -> Image:
    img = create(out / f"{name}.qcow2", 32 * MiB, "cluster_size=64k", f"preallocation={mode}")
    w = writer_for(out, name, 64 * KiB)
    scatter(w, 32 * MiB, 64 * KiB, count=12)
    w.run(img)
    return Image(img, [img])


def case_preallocation_metadata(out: Path) -> Image:
    return preallocated(out, "prealloc-meta", "metadata")


def case_preallocation_falloc(out: Path) -> Image:
    return preallocated(out, "prealloc-falloc", "falloc")


def case_internal_snapshots(out: Path) -> Image:
    """Snapshots of different content and disk size; the active layer differs again."""
    img = create(out / "snaps.qcow2", 32 * MiB, "cluster_size=64k")
    helpers.qemu_img("snapshot", "-c", "empty", img)
    w = writer_for(out, "snaps", 64 * KiB)
    scatter(w, 32 * MiB, 64 * KiB, count=16)
    w.run(img)
    helpers.qemu_img("snapshot", "-c", "first", img)
    helpers.qemu_img("resize", "-q", img, "48M")
    scatter(w, 48 * MiB, 64 * KiB, count=16)
    w.unique(40 * MiB, 1 * MiB)
    w.run(img)
    helpers.qemu_img("snapshot", "-c", "second", img)
    w.zero(0, 2 * MiB)
    w.pattern(3 * MiB + 5, 3 * MiB)
    w.run(img)
    return Image(img, [img], ["empty", "first", "second"])


def case_dirty_lazy_refcounts(out: Path) -> Image:
    """An image left with the dirty bit set by a writer that died (lazy_refcounts)."""
    img = create(out / "dirty.qcow2", 24 * MiB, "cluster_size=64k", "lazy_refcounts=on")
    w = writer_for(out, "dirty", 64 * KiB)
    scatter(w, 24 * MiB, 64 * KiB, count=12, zeroes=False)
    args = ["qemu-io", "-f", "qcow2"]
    for c in w.cmds + ["abort"]:
        args += ["-c", c]
    subprocess.run([*args, str(img)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=120, check=False)
    assert qcow2_meta.get_field(img, "incompatible_features") & qcow2_meta.INCOMPAT_DIRTY, \
        "qemu-io abort did not leave the dirty bit set"
    return Image(img, [img])


def case_corrupt_bit(out: Path) -> Image:
    """A valid image flagged corrupt: must still be readable read-only."""
    image = plain(out, "corrupt", 16 * MiB, 64 * KiB)
    qcow2_meta.set_field(image.path, "incompatible_features",
                           qcow2_meta.get_field(image.path, "incompatible_features")
                           | qcow2_meta.INCOMPAT_CORRUPT)
    return image


def case_persistent_bitmaps(out: Path) -> Image:
    """Dirty bitmaps (bitmaps header extension, autoclear bit): reading ignores them."""
    image = plain(out, "bitmaps", 24 * MiB, 64 * KiB)
    helpers.qemu_img("bitmap", "--add", "-f", "qcow2", image.path, "bm0")
    helpers.qemu_img("bitmap", "--add", "-g", "512k", "-f", "qcow2", image.path, "bm1")
    w = writer_for(out, "bitmaps-2", 64 * KiB)
    scatter(w, 24 * MiB, 64 * KiB, count=8, zeroes=False)
    w.run(image.path)
    return image


def case_unknown_extension_and_optional_bits(out: Path) -> Image:
    """An unknown header extension plus unknown compatible and autoclear bits: all ignorable."""
    image = plain(out, "optional", 16 * MiB, 64 * KiB)
    exts = qcow2_meta.read_extensions(image.path)
    exts.insert(0, (0x12345678, b"opaque extension data"))
    qcow2_meta.write_extensions(image.path, exts)
    for name, bit in (("compatible_features", 1 << 40), ("autoclear_features", 1 << 40)):
        qcow2_meta.set_field(image.path, name, qcow2_meta.get_field(image.path, name) | bit)
    return image


CASES: dict[str, Callable[[Path], Image]] = {
    name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}


def build(name: str, out: Path) -> Image:
    """Builds case name into the (existing, empty) directory out."""
    image = CASES[name](out)
    for src in out.glob(".src-*"):
        src.unlink()
    return image


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "--list":
        print("\n".join(CASES))
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[1])
    names = argv[2:] or list(CASES)
    for name in names:
        out = root / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        image = build(name, out)
        print(f"{name}: {image.path}" + (f" snapshots={image.snapshots}" if image.snapshots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
