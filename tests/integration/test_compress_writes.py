"""compress=on: filling a fresh qcow2 image through a read-write mount stores
whole clusters written into unallocated space compressed, as qemu-img convert -c
would, with QEMU as the referee.

A 32 MiB source disk (text-like clusters, zeros, random clusters, holes) is
written through a compress=on mount with dd. After unmount `qemu-img check`
must be clean, `qemu-img compare` must call image and source identical,
`qemu-img map` must show the compressible ranges compressed (QEMU 7.2 reports a
compressed cluster as data without a host offset) and the random ones as plain
data, and the file must be within 10% of what `qemu-img convert -c` makes of
the same bytes. A second mount overwrites compressed clusters (partial and
whole) and fills a hole; check and compare again. A zstd image likewise.
Refusals: other formats, read-only mounts, external data files.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

from qcowfs_testlib import helpers

MiB = 1 << 20
CLUSTER = 64 * 1024
SIZE = 32 * MiB

WORDS = [b"the ", b"qcow2 ", b"cluster ", b"refcount ", b"of ", b"guest ", b"host ", b"table ",
         b"compressed ", b"stream ", b"sector ", b"entry ", b"\n", b"disk ", b"image ", b"write "]


def text(rnd: random.Random, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        out += rnd.choice(WORDS)
    return bytes(out[:n])


# (start, length, kind) of the source disk; the rest is a hole. The fill
# writes the first FILLED bytes (zeros included); past them the image stays
# unallocated.
LAYOUT = [
    (0, 4 * MiB, "text"),
    (4 * MiB, 1 * MiB, "zero"),
    (5 * MiB, 1 * MiB, "random"),
    (6 * MiB, 3 * MiB, "text"),
]
FILLED = 10 * MiB


def make_source(path: Path, size: int, layout, seed: int) -> None:
    rnd = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)
        for start, length, kind in layout:
            f.seek(start)
            if kind == "text":
                f.write(text(rnd, length))
            elif kind == "zero":
                f.write(bytes(length))
            else:
                f.write(rnd.randbytes(length))


def fill_through_mount(img: Path, src: Path, workdir: Path, length: int) -> None:
    """dd of the source's first length bytes into the view, 1 MiB O_DIRECT writes."""
    with helpers.mounted(img, workdir / "view", ["rw", "compress=on"]) as m:
        helpers.run(["dd", f"if={src}", f"of={m.path}", "bs=1M", f"count={length // MiB}",
                     "oflag=direct", "conv=notrunc,fsync", "status=none"])


def compare(img: Path, raw: Path) -> None:
    proc = subprocess.run(["qemu-img", "compare", "-f", "qcow2", "-F", "raw", str(img), str(raw)],
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, f"qemu-img compare: {proc.stdout.decode()}{proc.stderr.decode()}"


def map_kind(entries: list[dict], start: int, end: int) -> set[str]:
    """How qemu-img map reports [start, end): compressed (data, no host offset),
    data (with an offset), zero or unallocated."""
    kinds = set()
    for e in entries:
        if e["start"] + e["length"] <= start or e["start"] >= end:
            continue
        if e["data"] and "offset" not in e:
            kinds.add("compressed")
        elif e["data"]:
            kinds.add("data")
        else:
            kinds.add("zero" if e["zero"] else "unallocated")
    return kinds


def assert_layout_mapped(img: Path, layout) -> None:
    entries = helpers.qemu_img_map(img)
    for start, length, kind in layout:
        want = "data" if kind == "random" else "compressed"
        got = map_kind(entries, start, start + length)
        assert got == {want}, f"{kind} range {start:#x}+{length:#x} maps as {got}, expected {want}"


def test_fill_overwrite_and_size_against_qemu(workdir: Path):
    src = workdir / "src.raw"
    make_source(src, SIZE, LAYOUT, 1)
    img = workdir / "disk.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    fill_through_mount(img, src, workdir, FILLED)
    helpers.qemu_img_check(img)
    compare(img, src)
    assert_layout_mapped(img, LAYOUT)
    # Never written: unallocated, which qemu-img map shows as zero (no backing file).
    assert map_kind(helpers.qemu_img_map(img), FILLED, SIZE) == {"zero"}

    ref = workdir / "ref.qcow2"
    helpers.qemu_img("convert", "-q", "-c", "-f", "raw", "-O", "qcow2", src, ref)
    ours, theirs = img.stat().st_size, ref.stat().st_size
    assert abs(ours - theirs) <= theirs // 10, f"compress=on image {ours} bytes, qemu-img convert -c {theirs}"

    # Second mount: a partial and a whole overwrite of compressed clusters
    # (stored uncompressed, copy-on-write from the stream) and a hole filled
    # never written (compressed, in a cluster of this session).
    rnd = random.Random(2)
    edits = [(CLUSTER + 4096, text(rnd, 3000)), (5 * CLUSTER, text(rnd, CLUSTER)),
             (24 * MiB, text(rnd, 4 * CLUSTER))]
    with helpers.mounted(img, workdir / "view", ["rw", "compress=on"]) as m:
        fd = os.open(m.path, os.O_WRONLY)
        try:
            for off, data in edits:
                os.pwrite(fd, data, off)
            os.fsync(fd)
        finally:
            os.close(fd)
    with open(src, "r+b") as f:
        for off, data in edits:
            f.seek(off)
            f.write(data)
    helpers.qemu_img_check(img)
    compare(img, src)
    entries = helpers.qemu_img_map(img)
    assert map_kind(entries, CLUSTER, 2 * CLUSTER) == {"data"}
    assert map_kind(entries, 5 * CLUSTER, 6 * CLUSTER) == {"data"}
    assert map_kind(entries, 2 * CLUSTER, 5 * CLUSTER) == {"compressed"}
    assert map_kind(entries, 24 * MiB, 24 * MiB + 4 * CLUSTER) == {"compressed"}


def test_zstd_image(workdir: Path):
    size = 8 * MiB
    layout = [(0, 3 * MiB, "text"), (3 * MiB, 1 * MiB, "random"), (4 * MiB, 2 * MiB, "text")]
    src = workdir / "src.raw"
    make_source(src, size, layout, 3)
    img = workdir / "zstd.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", "compression_type=zstd", img, str(size))
    fill_through_mount(img, src, workdir, size)
    helpers.qemu_img_check(img)
    compare(img, src)
    assert_layout_mapped(img, layout)
    assert helpers.qemu_img_info(img)["format-specific"]["data"]["compression-type"] == "zstd"


def test_compress_is_refused_where_it_cannot_apply(workdir: Path):
    raw = workdir / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(MiB)
    _, err = helpers.mount_fails(raw, workdir / "v1", ["rw", "compress=on", "format=raw"])
    assert "compress=on is for qcow2 images" in err, err
    img = workdir / "disk.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(MiB))
    _, err = helpers.mount_fails(img, workdir / "v2", ["compress=on"])
    assert "needs rw" in err, err
    ext = workdir / "ext.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={workdir / 'ext.data'}", ext, str(MiB))
    _, err = helpers.mount_fails(ext, workdir / "v3", ["rw", "compress=on"])
    assert "external data file" in err, err
