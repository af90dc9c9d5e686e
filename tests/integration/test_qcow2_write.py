"""qcow2 write path through a real read-write mount, with QEMU as the referee.

Every image kind qemu-img makes (plain, backing chain, extended L2, compressed,
v2, internal snapshot, 512-byte and 2 MiB clusters) receives the same
deterministic sequence of writes, hole punches, zero ranges and a growth, both
through the mount and on a raw copy made by `qemu-img convert`. After a clean
unmount `qemu-img check` must find nothing (no corruption, no leaks) and
`qemu-img compare` must call the image and the raw copy identical. fio then
writes with --verify=crc32c, and a kill -9 under write load with periodic
fsync must leave an image with no corruption whose fsynced data is intact.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers
from qcowfs_testlib import qcow2_meta
from qcowfs_testlib.qcow2_meta import Qcow2

MiB = 1 << 20
SIZE = 64 * MiB


# --------------------------------------------------------------------------
# Images


def make_image(workdir: Path, kind: str) -> Path:
    """Builds one image of the given kind with some data already in it."""
    img = workdir / f"{kind}.qcow2"
    q = helpers.qemu_img
    if kind == "plain":
        q("create", "-q", "-f", "qcow2", img, str(SIZE))
        helpers.qemu_io(img, "write -P 0x11 1M 3M", "write -P 0x22 20M 64k")
    elif kind == "backing":
        base = workdir / "base.qcow2"
        q("create", "-q", "-f", "qcow2", base, str(SIZE))
        helpers.qemu_io(base, "write -P 0x33 0 8M", "write -P 0x44 30M 5M")
        q("create", "-q", "-f", "qcow2", "-b", base.name, "-F", "qcow2", img)
        helpers.qemu_io(img, "write -P 0x55 4M 1M")
    elif kind == "extended_l2":
        base = workdir / "base.qcow2"
        q("create", "-q", "-f", "qcow2", base, str(SIZE))
        helpers.qemu_io(base, "write -P 0x66 0 16M")
        q("create", "-q", "-f", "qcow2", "-o", "extended_l2=on,cluster_size=64k", "-b", base.name,
          "-F", "qcow2", img)
        helpers.qemu_io(img, "write -P 0x77 2k 2k", "write -P 0x78 100k 6k", "write -z 9M 8k")
    elif kind == "compressed":
        raw = workdir / "src.raw"
        with open(raw, "wb") as f:
            f.truncate(SIZE)
            rnd = random.Random(7)
            for i in range(0, 24 * MiB, 256 * 1024):
                f.seek(i)
                f.write(bytes([rnd.randrange(256)]) * 100000 + rnd.randbytes(2000))
        q("convert", "-q", "-c", "-f", "raw", "-O", "qcow2", raw, img)
        raw.unlink()
    elif kind == "v2":
        q("create", "-q", "-f", "qcow2", "-o", "compat=0.10", img, str(SIZE))
        helpers.qemu_io(img, "write -P 0x12 0 2M")
    elif kind == "snapshot":
        q("create", "-q", "-f", "qcow2", img, str(SIZE))
        helpers.qemu_io(img, "write -P 0x13 0 12M")
        q("snapshot", "-c", "snap1", img)
    elif kind == "clusters_512":
        q("create", "-q", "-f", "qcow2", "-o", "cluster_size=512", img, str(SIZE))
        helpers.qemu_io(img, "write -P 0x14 1000 70000")
    elif kind == "clusters_2m":
        q("create", "-q", "-f", "qcow2", "-o", "cluster_size=2M", img, str(SIZE))
        helpers.qemu_io(img, "write -P 0x15 3M 1M")
    else:
        raise ValueError(kind)
    return img


KINDS = ["plain", "backing", "extended_l2", "compressed", "v2", "snapshot", "clusters_512",
         "clusters_2m"]


# --------------------------------------------------------------------------
# The deterministic workload, applied to the mount and to the raw reference


def workload(seed: int, size: int) -> list[tuple]:
    rnd = random.Random(seed)
    ops: list[tuple] = []
    for _ in range(120):
        r = rnd.random()
        off = rnd.randrange(0, size - 1)
        if r < 0.70:
            n = rnd.choice([1, 511, 512, 4096, 6000, 65536, 65537, 300000, MiB])
            ops.append(("write", off, min(n, size - off), rnd.randrange(1 << 30)))
        elif r < 0.80:
            ops.append(("punch", off, min(rnd.randrange(1, 3 * MiB), size - off)))
        elif r < 0.90:
            ops.append(("zero", off, min(rnd.randrange(1, 3 * MiB), size - off)))
        else:
            ops.append(("fsync",))
    ops.append(("grow", size + 48 * MiB))
    grown = size + 48 * MiB
    for _ in range(15):
        off = rnd.randrange(size - MiB, grown - 1)
        ops.append(("write", off, min(rnd.randrange(1, 2 * MiB), grown - off), rnd.randrange(1 << 30)))
    ops.append(("punch", size + MiB, 5 * MiB))
    return ops


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10


def fallocate(fd: int, mode: int, off: int, n: int) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, mode, off, n) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def apply(path: Path, ops: list[tuple]) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        for op in ops:
            if op[0] == "write":
                _, off, n, seed = op
                os.pwrite(fd, random.Random(seed).randbytes(n), off)
            elif op[0] == "punch":
                fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, op[1], op[2])
            elif op[0] == "zero":
                fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, op[1], op[2])
            elif op[0] == "grow":
                os.ftruncate(fd, op[1])
            elif op[0] == "fsync":
                os.fsync(fd)
    finally:
        os.close(fd)


def compare(image: Path, raw: Path) -> None:
    proc = helpers.run(["qemu-img", "compare", "-f", "qcow2", "-F", "raw", image, raw], check=False)
    assert proc.returncode == 0, (f"qemu-img compare {image} {raw}: exit {proc.returncode}\n"
                                  f"{proc.stdout.decode()}{proc.stderr.decode()}")


# --------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("kind", KINDS)
def test_writes_discards_zeroes_growth_match_raw(workdir: Path, kind: str):
    img = make_image(workdir, kind)
    ref = helpers.convert_to_raw(img, workdir / "ref.raw")
    ops = workload(sum(kind.encode()), SIZE)
    apply(ref, ops)
    with helpers.mounted(img, workdir / "view.raw", ["rw"]) as m:
        apply(m.path, ops)
        assert os.path.getsize(m.path) == os.path.getsize(ref)
        assert helpers.files_equal(m.path, ref), "content through the mount differs from the reference"
    helpers.qemu_img_check(img)
    compare(img, ref)
    if kind == "snapshot":  # the snapshot still shows what it held
        snap = helpers.convert_to_raw(img, workdir / "snap.raw", snapshot="snap1")
        with open(snap, "rb") as f:
            assert f.read(12 * MiB) == b"\x13" * (12 * MiB)


@pytest.mark.parametrize("kind", ["plain", "backing", "extended_l2"])
@pytest.mark.parametrize("rw", ["randwrite", "write"])
def test_fio_verify(workdir: Path, kind: str, rw: str):
    if shutil.which("fio") is None:
        pytest.fail("fio is not installed (tests/setup-deps.sh)")
    img = make_image(workdir, kind)
    copy = workdir / "copy.raw"
    with helpers.mounted(img, workdir / "view.raw", ["rw", "cache=none"]) as m:
        bs = "--bs=4k" if rw == "randwrite" else "--bs=1M"
        helpers.run(["fio", "--name=w", f"--filename={m.path}", f"--rw={rw}", bs, "--size=48M",
                     "--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c",
                     "--do_verify=1", "--fsync=32"], timeout=300)
        shutil.copyfile(m.path, copy)
    helpers.qemu_img_check(img)
    compare(img, copy)


def test_parallel_writers_same_clusters(workdir: Path):
    """Concurrent writers into the same unallocated clusters lose nothing."""
    img = workdir / "p.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    ref = workdir / "ref.raw"
    with open(ref, "wb") as f:
        f.truncate(SIZE)
    with helpers.mounted(img, workdir / "view.raw", ["rw", "queues=4"]) as m:
        procs = []
        for w in range(4):
            script = ("import os,sys\n"
                      f"fd=os.open({str(m.path)!r},os.O_RDWR)\n"
                      "for i in range(400):\n"
                      f"    off=(i*4+{w})*1024\n"
                      f"    os.pwrite(fd,bytes([{w + 1}])*1024,off)\n")
            procs.append(subprocess.Popen(["python3", "-c", script]))
        for p in procs:
            assert p.wait(timeout=120) == 0
        with open(ref, "r+b") as f:
            for w in range(4):
                for i in range(400):
                    f.seek((i * 4 + w) * 1024)
                    f.write(bytes([w + 1]) * 1024)
        assert helpers.files_equal(m.path, ref)
    helpers.qemu_img_check(img)
    compare(img, ref)


def test_shrink_refused_over_data_allowed_over_nothing(workdir: Path):
    img = workdir / "s.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    helpers.qemu_io(img, "write -P 1 0 1M")
    with helpers.mounted(img, workdir / "view.raw", ["rw"]) as m:
        with pytest.raises(OSError) as e:
            os.truncate(m.path, 512 * 1024)
        assert e.value.errno == 22
        os.truncate(m.path, 2 * MiB)
        assert os.path.getsize(m.path) == 2 * MiB
    helpers.qemu_img_check(img)
    assert helpers.qemu_img_info(img)["virtual-size"] == 2 * MiB


def test_shrink_keeps_the_l1_table_as_qemu_does(workdir: Path):
    """qemu-img resize --shrink zeroes L1 entries past the end but keeps l1_size
    and the table's place: after the same shrink, both images agree."""
    ours, theirs = workdir / "ours.qcow2", workdir / "theirs.qcow2"
    for img in (ours, theirs):
        helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(2048 * MiB))
        helpers.qemu_io(img, "write -P 3 0 1M")
    assert qcow2_meta.get_field(ours, "l1_size") == 4
    with helpers.mounted(ours, workdir / "view.raw", ["rw"]) as m:
        os.truncate(m.path, 300 * MiB)
    helpers.qemu_img("resize", "-q", "--shrink", theirs, str(300 * MiB))
    for field in ("size", "l1_size", "l1_table_offset"):
        assert qcow2_meta.get_field(ours, field) == qcow2_meta.get_field(theirs, field), field
    helpers.qemu_img_check(ours)
    helpers.run(["qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", ours, theirs])


def test_discard_unmap_frees_host_space(workdir: Path):
    img = workdir / "d.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    helpers.qemu_io(img, "write -P 9 0 32M")
    before = os.stat(img).st_blocks
    with helpers.mounted(img, workdir / "view.raw", ["rw", "discard=unmap"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 32 * MiB)
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(m.path, "rb") as f:
            assert f.read(32 * MiB) == bytes(32 * MiB)
    helpers.qemu_img_check(img)
    assert os.stat(img).st_blocks < before - (24 * MiB // 512), "host space was not freed"


@contextlib.contextmanager
def small_ext4(workdir: Path, size_mb: int):
    fsimg = workdir / "fs.img"
    mnt = workdir / "fs"
    mnt.mkdir()
    with open(fsimg, "wb") as f:
        f.truncate(size_mb * MiB)
    helpers.run(["mkfs.ext4", "-q", "-F", fsimg])
    helpers.run(["mount", "-o", "loop", fsimg, mnt])
    try:
        yield mnt
    finally:
        helpers.run(["umount", "-l", mnt], check=False)


def test_enospc_leaves_image_consistent(workdir: Path):
    with small_ext4(workdir, 48) as fs:
        img = fs / "e.qcow2"
        helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(256 * MiB))
        filler = fs / "filler"
        helpers.run(["fallocate", "-l", "30M", filler])
        ref = workdir / "ref.raw"
        with open(ref, "wb") as f:
            f.truncate(256 * MiB)
        with helpers.mounted(img, workdir / "view.raw", ["rw", "cache=writeback"]) as m:
            fd = os.open(m.path, os.O_RDWR)
            try:
                got_enospc = False
                written = 0
                for i in range(64):
                    data = bytes([i + 1]) * MiB
                    try:
                        os.pwrite(fd, data, i * MiB)
                        os.fsync(fd)
                    except OSError as e:
                        assert e.errno == 28, f"expected ENOSPC, got {e}"
                        got_enospc = True
                        break
                    written = i + 1
                assert got_enospc, "the host never filled up"
                filler.unlink()
                for i in range(written, written + 4):  # fits now
                    os.pwrite(fd, bytes([i + 1]) * MiB, i * MiB)
                os.fsync(fd)
                with open(ref, "r+b") as f:
                    for i in range(written + 4):
                        f.seek(i * MiB)
                        f.write(bytes([i + 1]) * MiB)
            finally:
                os.close(fd)
            # Clusters of the failed write may read as zeros or as the data; compare the rest.
        report = helpers.run(["qemu-img", "check", "--output=json", "-f", "qcow2", img], check=False)
        assert report.returncode in (0, 3), report.stdout.decode() + report.stderr.decode()
        out = workdir / "out.raw"
        helpers.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, out])
        with open(out, "rb") as a, open(ref, "rb") as b:
            for i in range(written + 4):
                a.seek(i * MiB)
                b.seek(i * MiB)
                assert a.read(MiB) == b.read(MiB), f"MiB {i} differs"


def test_kill9_under_write_load(workdir: Path):
    img = workdir / "k.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    fh.kill9_under_write_load(img, "qcow2", workdir)


# --------------------------------------------------------------------------
# Persistent bitmaps and dirty images

BITMAPS_EXT = 0x23852875


def bitmap_clusters(img: Path) -> list[int]:
    """Host clusters of the bitmap directory, each bitmap table and its data."""
    q = Qcow2(img)
    ext = dict(qcow2_meta.read_extensions(img))[BITMAPS_EXT]
    nb, _, dir_size, dir_offset = struct.unpack(">IIQQ", ext[:24])
    clusters = {dir_offset // q.cs}
    pos = dir_offset
    for _ in range(nb):
        table, table_size, _flags, _type, _gran, name_size, extra = struct.unpack(">QIIBBHI", q.read(pos, 24))
        clusters.add(table // q.cs)
        clusters.update(q.u64(table + 8 * i) // q.cs for i in range(table_size) if q.u64(table + 8 * i))
        pos += (24 + extra + name_size + 7) // 8 * 8
    assert pos - dir_offset <= dir_size
    return sorted(clusters)


@pytest.mark.parametrize("dirty,write", [(True, False), (True, True), (False, True)])
def test_persistent_bitmaps(workdir: Path, dirty: bool, write: bool):
    """A dirty image's refcounts are rebuilt counting the bitmaps as qemu does;
    the bitmaps are kept (stored again at unmount after a write, test_bitmaps.py
    checks their bits), so qemu-img check finds no leak either way."""
    img = workdir / "b.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    helpers.qemu_img("bitmap", "--add", img, "b0")
    helpers.qemu_img("bitmap", "--add", "-g", "128k", img, "b1")
    helpers.qemu_io(img, "write -P 7 8M 1M")  # sets bits: the bitmaps get data clusters
    held = bitmap_clusters(img)
    assert len(held) >= 4, f"expected directory, two tables and data clusters, got {held}"
    if dirty:
        q = Qcow2(img)
        for c in held:  # refcounts a rebuild that skips the bitmaps would leave wrong
            q.set_refcount(c, 0)
        flags = qcow2_meta.get_field(img, "incompatible_features")
        qcow2_meta.set_field(img, "incompatible_features", flags | qcow2_meta.INCOMPAT_DIRTY)
    ref = helpers.convert_to_raw(img, workdir / "ref.raw")
    with helpers.mounted(img, workdir / "view.raw", ["rw"]) as m:
        if write:
            with open(m.path, "r+b") as f:
                f.seek(20 * MiB)
                f.write(b"\x5a" * MiB)
            with open(ref, "r+b") as f:
                f.seek(20 * MiB)
                f.write(b"\x5a" * MiB)
    helpers.qemu_img_check(img)
    compare(img, ref)
    assert not qcow2_meta.get_field(img, "incompatible_features") & qcow2_meta.INCOMPAT_DIRTY
    info = helpers.qemu_img_info(img)
    bitmaps = info.get("format-specific", {}).get("data", {}).get("bitmaps", [])
    assert [(b["name"], b["flags"]) for b in bitmaps] == [("b0", ["auto"]), ("b1", ["auto"])], bitmaps
    assert qcow2_meta.get_field(img, "autoclear_features") & 1
    if not write:
        q = Qcow2(img)
        assert [q.refcount(c) for c in held] == [1] * len(held)


# --------------------------------------------------------------------------
# External data file


def make_data_file_image(workdir: Path, raw: bool) -> Path:
    img = workdir / "x.qcow2"
    opts = f"data_file={workdir / 'x.data'}" + (",data_file_raw=on" if raw else "")
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", opts, img, str(SIZE))
    helpers.qemu_io(img, "write -P 0x21 1M 3M", "write -P 0x22 20M 64k")
    return img


@pytest.mark.parametrize("raw", [False, True], ids=["data_file", "data_file_raw"])
def test_external_data_file_writes_match_raw(workdir: Path, raw: bool):
    img = make_data_file_image(workdir, raw)
    ref = helpers.convert_to_raw(img, workdir / "ref.raw")
    ops = workload(99, SIZE)
    apply(ref, ops)
    with helpers.mounted(img, workdir / "view.raw", ["rw"]) as m:
        apply(m.path, ops)
        assert helpers.files_equal(m.path, ref), "content through the mount differs from the reference"
    helpers.qemu_img_check(img)
    compare(img, ref)
    if raw:  # data_file_raw: the data file alone is the guest disk, size included
        assert helpers.files_equal(workdir / "x.data", ref), "the raw data file differs from the guest disk"
        assert os.path.getsize(workdir / "x.data") == os.path.getsize(ref)


@pytest.mark.parametrize("raw", [False, True], ids=["data_file", "data_file_raw"])
def test_external_data_file_fio_verify(workdir: Path, raw: bool):
    if shutil.which("fio") is None:
        pytest.fail("fio is not installed (tests/setup-deps.sh)")
    img = make_data_file_image(workdir, raw)
    copy = workdir / "copy.raw"
    with helpers.mounted(img, workdir / "view.raw", ["rw", "cache=none"]) as m:
        helpers.run(["fio", "--name=w", f"--filename={m.path}", "--rw=randwrite", "--bs=4k", "--size=32M",
                     "--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c",
                     "--do_verify=1", "--fsync=32"], timeout=300)
        shutil.copyfile(m.path, copy)
    helpers.qemu_img_check(img)
    compare(img, copy)
