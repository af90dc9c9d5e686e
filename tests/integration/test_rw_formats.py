"""Read-write mounts of the table formats (VDI, Parallels, QED, fixed and dynamic VHD, VHDX so far), with QEMU as the
referee. For each writable variant: fio random and sequential writes with
--verify through the mount (QD32, 512 B to 1 MiB, cache=none and writeback),
punched and zeroed ranges, unaligned writes and the partly used last block,
growth (refused where QEMU cannot resize the format); after a clean unmount
`qemu-img check` is clean, `qemu-img convert -O raw` equals the view as read
back, and a remount shows the same bytes. Plus kill -9 under a write load with
fsync (format_helpers.kill9_under_write_load), VHDX block states after a
punch (whole blocks of a dynamic image unmapped, their space freed and reused),
and the VDI block map after a punch (whole blocks of a dynamic image discarded,
the last data blocks moved into their place, the file cut); punches beside a
verified write load for both."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import shutil
import threading
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers


from qcowfs_testlib import vhdx_edit

KiB, MiB = 1 << 10, 1 << 20

# variant -> (format, qemu-img create options, allocation unit)
VARIANTS = {
    "vdi-dynamic": ("vdi", "", MiB),
    "vdi-static": ("vdi", "static=on", MiB),
    "parallels": ("parallels", "", MiB),
    "parallels-64k": ("parallels", "cluster_size=65536", 64 * KiB),
    "qed": ("qed", "", 64 * KiB),
    "vpc-fixed": ("vpc", "subformat=fixed,force_size=on", 2 * MiB),
    "vpc-dynamic": ("vpc", "subformat=dynamic,force_size=on", 2 * MiB),
    "vmdk-sparse": ("vmdk", "", 64 * KiB),
    "vmdk-flat": ("vmdk", "subformat=monolithicFlat", 64 * KiB),
    # The split subformats: a descriptor file and extent files of their own
    # (one at this size; test_vmdk_split_image_written_across_its_extent_boundary
    # writes across two).
    "vmdk-sparse-2gb": ("vmdk", "subformat=twoGbMaxExtentSparse", 64 * KiB),
    "vmdk-flat-2gb": ("vmdk", "subformat=twoGbMaxExtentFlat", 64 * KiB),
    "vhdx-dynamic": ("vhdx", "", 8 * MiB),
    "vhdx-fixed": ("vhdx", "subformat=fixed,block_state_zero=off", 8 * MiB),
    # Not QED with 4 KiB clusters here: qemu-img check 7.2 reports one leaked
    # cluster per full L2 table after the first, also on images qemu-io wrote
    # alone (image/qed/DESIGN.md); the unit tests write such images.
}
# The one error qemu-img check reports of an image not closed (its in-use flag).
UNCLEAN = {"parallels": "image was not closed correctly"}
# Formats qemu-img check can check (vpc: "This image format does not support checks").
CHECKABLE = {"vdi", "parallels", "qed", "vmdk", "vhdx"}
# Formats qemu-img resize can grow.
RESIZABLE = {"qed"}

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def make(workdir: Path, variant: str, size: int) -> tuple[Path, str]:
    fmt, opts, unit = VARIANTS[variant]
    image = fh.make_image(workdir, fmt, f"disk.{fmt}", size, opts, fh.scattered_writes(size, unit, seed=3))
    return image, fmt


def fio_verify(path: Path, *args: str) -> None:
    if shutil.which("fio") is None:
        pytest.fail("fio is not installed (tests/setup-deps.sh)")
    proc = helpers.run(["fio", "--name=rw", f"--filename={path}", "--ioengine=io_uring", "--iodepth=32",
                        "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--randrepeat=0",
                        "--output-format=terse", *args], check=False, timeout=300)
    assert proc.returncode == 0, (
        f"fio {' '.join(args)} failed:\n{proc.stdout.decode()}{proc.stderr.decode(errors='replace')}")


def edit_view(path: Path, size: int, resizable: bool) -> None:
    """Punch, zero, unaligned writes, the last bytes, growth; checked at once."""
    rng = random.Random(size)
    fd = os.open(path, os.O_RDWR)
    try:
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 3 * MiB + 512, 2 * MiB + 4096)
        fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 9 * MiB - 777, 1 * MiB + 1554)
        assert os.pread(fd, 2 * MiB + 4096, 3 * MiB + 512) == bytes(2 * MiB + 4096), "punched range not zero"
        assert os.pread(fd, MiB + 1554, 9 * MiB - 777) == bytes(MiB + 1554), "zeroed range not zero"
        for _ in range(20):
            off = rng.randrange(size - 70000)
            data = rng.randbytes(rng.choice([1, 3, 511, 4097, 65537]))
            assert os.pwrite(fd, data, off) == len(data)
            assert os.pread(fd, len(data), off) == data, f"unaligned write at {off} reads back wrong"
        tail = rng.randbytes(1000)
        assert os.pwrite(fd, tail + b"x", size - 1000) == 1000, "a write across the end is short"
        if resizable:
            os.ftruncate(fd, size + MiB)
            assert os.fstat(fd).st_size == size + MiB
        else:
            with pytest.raises(OSError) as e:
                os.ftruncate(fd, size + MiB)
            assert e.value.errno == errno.EINVAL, e.value
            assert os.fstat(fd).st_size == size, "a refused resize changed the size"
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("cache", ["none", "writeback"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_writes_verify_and_qemu_reads_them(workdir: Path, variant: str, cache: str) -> None:
    # 24 MiB: several allocation units of every variant (three of VHDX's 8 MiB blocks), and the
    # last unit is used in part.
    size = 24 * MiB + 3 * 512
    image, fmt = make(workdir, variant, size)
    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "view.raw", ["rw", f"cache={cache}", f"format={fmt}"]) as m:
        fio_verify(m.path, "--rw=randwrite", "--bsrange=512-1M", "--offset=0", "--size=12M", "--direct=1")
        fio_verify(m.path, "--rw=write", "--bs=1M", "--offset=12M", "--size=8M", "--direct=1")
        fio_verify(m.path, "--rw=randrw", "--bs=4k", "--offset=20M", "--size=4M")
        edit_view(m.path, size, fmt in RESIZABLE)
        shutil.copyfile(m.path, copy)
    if fmt in CHECKABLE:
        helpers.qemu_img_check(image, fmt)
    reference = helpers.convert_to_raw(image, workdir / "qemu.raw", fmt=fmt)
    assert helpers.files_equal(reference, copy), (
        f"{variant}: qemu-img convert differs from the view at byte "
        f"{helpers.first_difference(reference.read_bytes(), copy.read_bytes())}")
    with helpers.mounted(image, workdir / "again.raw", [f"format={fmt}"]) as m:
        fh.assert_view_equals(m.path, copy, image)


@pytest.mark.parametrize("variant", ["vdi-dynamic", "parallels", "qed", "vmdk-sparse", "vhdx-dynamic", "vpc-dynamic"])
def test_kill9_under_write_load(workdir: Path, variant: str) -> None:
    fmt, opts, _ = VARIANTS[variant]
    image = fh.make_image(workdir, fmt, f"k.{fmt}", 64 * MiB, opts)
    fh.kill9_under_write_load(image, fmt, workdir, UNCLEAN.get(fmt))


def test_vdi_block_map_that_could_overwrite_a_block_is_refused_for_writing(workdir: Path) -> None:
    """blocks_allocated below a block in use: a new block would overwrite it."""
    image = fh.make_image(workdir, "vdi", "bad.vdi", 8 * MiB, "", ["write -P 1 0 4k", "write -P 2 1M 4k"])
    with open(image, "r+b") as f:
        f.seek(388)  # blocks_allocated
        f.write((1).to_bytes(4, "little"))
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view", ["rw"])
    assert code != 0 and "not below blocks_allocated" in text and "read-only" in text, text
    assert helpers.sha256_file(image) == before


def test_parallels_in_use_flag(workdir: Path) -> None:
    """Set on disk while mounted read-write, cleared by the unmount; an image
    left in use is refused read-write with QEMU's words and still mounts
    read-only."""
    image = fh.make_image(workdir, "parallels", "p.hds", 8 * MiB, "", ["write -P 1 0 64k"])
    inuse_at = 44
    with helpers.mounted(image, workdir / "view.raw", ["rw"]) as m:
        with open(image, "rb") as f:
            f.seek(inuse_at)
            assert f.read(4) == (0x746F6E59).to_bytes(4, "little"), "inuse not set while mounted read-write"
        with open(m.path, "r+b") as v:
            v.seek(3 * MiB)
            v.write(b"\x77" * 4096)
    with open(image, "rb") as f:
        f.seek(inuse_at)
        assert f.read(4) == bytes(4), "inuse still set after the unmount"
    helpers.qemu_img_check(image, "parallels")
    with open(image, "r+b") as f:
        f.seek(inuse_at)
        f.write((0x746F6E59).to_bytes(4, "little"))
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view2", ["rw"])
    assert code != 0 and "not closed correctly" in text and "read-only" in text, text
    assert helpers.sha256_file(image) == before
    reference = helpers.convert_to_raw(image, workdir / "ref.raw", fmt="parallels")
    with helpers.mounted(image, workdir / "view3.raw", []) as m:
        assert helpers.files_equal(m.path, reference)


def test_qed_over_a_backing_file_copies_on_write(workdir: Path) -> None:
    """Partial clusters of a QED overlay are filled from its backing file in
    the same host write; QEMU reads the overlay as the mount showed it."""
    size = 24 * MiB
    base = workdir / "base.raw"
    helpers.run(["qemu-img", "create", "-q", "-f", "raw", base, str(size)])
    helpers.qemu_io(base, "write -P 0x61 0 24M", fmt="raw")
    overlay = workdir / "top.qed"
    helpers.run(["qemu-img", "create", "-q", "-f", "qed", "-b", base, "-F", "raw", overlay, str(size)])
    copy = workdir / "copy.raw"
    rng = random.Random(7)
    with helpers.mounted(overlay, workdir / "view.raw", ["rw", "cache=none"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            for _ in range(40):  # in [0, 12 MiB); fio writes [12, 20) MiB; [20, 24) MiB stays the base's
                off = rng.randrange(12 * MiB - 70000)
                data = rng.randbytes(rng.choice([1, 512, 4097, 65536]))
                assert os.pwrite(fd, data, off) == len(data)
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 5 * MiB + 100, 300 * KiB)
            assert os.pread(fd, 300 * KiB, 5 * MiB + 100) == bytes(300 * KiB)
        finally:
            os.close(fd)
        fio_verify(m.path, "--rw=randwrite", "--bsrange=512-256k", "--offset=12M", "--size=8M", "--direct=1")
        shutil.copyfile(m.path, copy)
    helpers.qemu_img_check(overlay, "qed")
    reference = helpers.convert_to_raw(overlay, workdir / "qemu.raw", fmt="qed")
    assert helpers.files_equal(reference, copy), "qemu-img convert of the overlay differs from the view"
    with open(copy, "rb") as f:
        f.seek(20 * MiB)
        assert f.read(MiB) == b"\x61" * MiB, "the backing file's bytes do not show through"


def test_fixed_vhd_whose_data_would_reach_the_footer_is_refused_for_writing(workdir: Path) -> None:
    image = fh.make_image(workdir, "vpc", "f.vhd", 8 * MiB, "subformat=fixed,force_size=on", ["write -P 1 0 4k"])
    data = image.read_bytes()
    image.write_bytes(data[:4 * MiB] + data[-512:])  # the footer still says 8 MiB
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view", ["rw"])
    assert code != 0 and "would reach its footer" in text, text
    assert helpers.sha256_file(image) == before


def test_dynamic_vhd_whose_block_overlaps_the_bat_is_refused_for_writing(workdir: Path) -> None:
    """A BAT entry naming the BAT's own sector: a write there would change the BAT."""
    image = fh.make_image(workdir, "vpc", "d.vhd", 8 * MiB, "subformat=dynamic", ["write -P 1 0 4k"])
    with open(image, "r+b") as f:
        f.seek(1536 + 4)  # the BAT (qemu-img puts it at 1536), entry 1
        f.write((1536 // 512).to_bytes(4, "big"))
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view", ["rw"])
    assert code != 0 and "overlaps block 1" in text and "read-only" in text, text
    assert helpers.sha256_file(image) == before
    with helpers.mounted(image, workdir / "ro.raw", ["format=vpc"]) as m:
        assert m.path.read_bytes()[:4096] == b"\x01" * 4096


@pytest.mark.parametrize("subformat", ["twoGbMaxExtentSparse", "twoGbMaxExtentFlat"])
def test_vmdk_split_image_written_across_its_extent_boundary(workdir: Path, subformat: str) -> None:
    """A request across the 2 GiB boundary of a split image goes to both
    extent files (a sparse run never leaves its file); QEMU reads it back."""
    size = 2 * 1024 * MiB + 8 * MiB
    image = fh.make_image(workdir, "vmdk", "split.vmdk", size, f"subformat={subformat}")
    boundary = 2 * 1024 * MiB
    at, n = boundary - MiB - 777, 3 * MiB + 1234
    with helpers.mounted(image, workdir / "view.raw", ["rw", "cache=none"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            assert os.pwrite(fd, b"\x5b" * n, at) == n
            assert os.pwrite(fd, b"\x5a" * 4096, boundary + 4 * MiB) == 4096
            os.fsync(fd)
        finally:
            os.close(fd)
    helpers.qemu_img_check(image, "vmdk")
    checks = [(0x00, boundary - 2 * MiB, at - (boundary - 2 * MiB)), (0x5b, at, n),
              (0x00, at + n, boundary + 4 * MiB - (at + n)), (0x5a, boundary + 4 * MiB, 4096),
              (0x00, boundary + 4 * MiB + 4096, 4 * MiB - 4096)]
    for pattern, off, length in checks:
        out = helpers.qemu_io(image, f"read -P {pattern} {off} {length}", fmt="vmdk", extra=["-r"])
        assert "verification failed" not in out and "failed" not in out, f"{pattern:#x} at {off}+{length}: {out}"


def vmdk_cid(image: Path) -> int:
    return helpers.qemu_img_info(image, fmt="vmdk")["format-specific"]["data"]["cid"]


def test_vmdk_delta_copies_on_write_and_its_first_write_changes_the_cid(workdir: Path) -> None:
    """Partial grains of a delta are filled from its parent in the same host
    write; the first write of a mount gives the delta a new CID (as QEMU's
    vmdk_write_cid), so a delta made on it no longer matches; a mount that
    writes nothing keeps the CID."""
    size = 16 * MiB
    base = fh.make_image(workdir, "vmdk", "base.vmdk", size, "", ["write -P 0x61 0 16M"])
    delta = workdir / "delta.vmdk"
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-b", base, "-F", "vmdk", delta])
    cid = vmdk_cid(delta)
    with helpers.mounted(delta, workdir / "ro.raw", ["rw"]) as m:
        assert m.path.stat().st_size == size
    assert vmdk_cid(delta) == cid, "a mount without writes changed the CID"
    child = workdir / "child.vmdk"
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-b", delta, "-F", "vmdk", child])
    rng = random.Random(11)
    copy = workdir / "copy.raw"
    with helpers.mounted(delta, workdir / "view.raw", ["rw", "cache=none"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            for _ in range(30):
                off = rng.randrange(12 * MiB)
                data = rng.randbytes(rng.choice([1, 512, 4097, 65536, 200000]))
                assert os.pwrite(fd, data, off) == len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.copyfile(m.path, copy)
    assert vmdk_cid(delta) != cid, "the first write did not change the CID"
    helpers.qemu_img_check(delta, "vmdk")
    reference = helpers.convert_to_raw(delta, workdir / "qemu.raw", fmt="vmdk")
    assert helpers.files_equal(reference, copy), "qemu-img convert of the delta differs from the view"
    with open(copy, "rb") as f:
        f.seek(12 * MiB + 300000)
        assert f.read(MiB) == b"\x61" * MiB, "the parent's bytes do not show through"
    proc = helpers.run(["qemu-io", "-f", "vmdk", "-c", "read 0 512", child], check=False)
    assert proc.returncode != 0 or b"failed" in proc.stdout + proc.stderr, "QEMU still reads the stale child"


def test_vmdk_grain_that_a_new_grain_could_overwrite_is_refused_for_writing(workdir: Path) -> None:
    """A grain-table entry past the end of the file: the next new grain would
    land on it. Refused read-write, image unchanged; read-only still mounts."""
    image = fh.make_image(workdir, "vmdk", "bad.vmdk", 8 * MiB, "", ["write -P 1 0 64k"])
    info = helpers.qemu_img_map(image, fmt="vmdk")
    grain_at = next(e["offset"] for e in info if e.get("data") and "offset" in e)
    raw = bytearray(image.read_bytes())
    sector = (grain_at // 512).to_bytes(4, "little")
    past_end = ((len(raw) + 10 * MiB) // 512).to_bytes(4, "little")
    grain_area = int.from_bytes(raw[64:72], "little") * 512
    named = [at for at in range(512, grain_area, 4) if raw[at:at + 4] == sector]
    assert named, "no grain table entry names the grain"
    for at in named:  # its entries in the grain table and the redundant one
        raw[at:at + 4] = past_end
    image.write_bytes(bytes(raw))
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view", ["rw"])
    assert code != 0 and "outside the grains" in text and "read-only" in text, text
    assert helpers.sha256_file(image) == before
    with helpers.mounted(image, workdir / "ro.raw", []) as m:
        assert m.path.stat().st_size == 8 * MiB


@pytest.mark.parametrize("fmt,opts", [("qed", ""), ("vmdk", "zeroed_grain=on")], ids=["qed", "vmdk"])
def test_zeroing_over_a_backing_file_records_zero_units(workdir: Path, fmt: str, opts: str) -> None:
    """Whole units zeroed over a backing file take the format's zero state
    (QED zero clusters, VMDK zeroed grains: nothing allocated); the partial
    units at the ends are written. QEMU reads zeros there and the backing
    file's bytes around them."""
    size = 16 * MiB
    base = workdir / ("base.raw" if fmt == "qed" else "base.vmdk")
    if fmt == "qed":
        helpers.run(["qemu-img", "create", "-q", "-f", "raw", base, str(size)])
        helpers.qemu_io(base, "write -P 0x61 0 16M", fmt="raw")
    else:
        base = fh.make_image(workdir, "vmdk", "base.vmdk", size, "", ["write -P 0x61 0 16M"])
    overlay = workdir / f"top.{fmt}"
    create = ["qemu-img", "create", "-q", "-f", fmt, "-b", base, "-F", "raw" if fmt == "qed" else "vmdk"]
    if opts:
        create += ["-o", opts]
    helpers.run([*create, overlay, str(size)] if fmt == "qed" else [*create, overlay])
    start, length = MiB + 100, 6 * MiB
    grown_before = overlay.stat().st_size
    with helpers.mounted(overlay, workdir / "view.raw", ["rw", "cache=none"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, start, length)
            assert os.pread(fd, length, start) == bytes(length)
            os.fsync(fd)
        finally:
            os.close(fd)
    helpers.qemu_img_check(overlay, fmt)
    assert overlay.stat().st_size - grown_before <= 4 * MiB, "whole units were allocated to hold zeros"
    zero = [e for e in helpers.qemu_img_map(overlay, fmt=fmt) if e["zero"] and e["depth"] == 0]
    covered = sum(e["length"] for e in zero)
    assert covered >= length - 2 * MiB, f"QEMU sees {covered} zero bytes in the overlay: {zero}"
    for pattern, off, n in [(0x61, 0, start), (0, start, length), (0x61, start + length, size - start - length)]:
        helpers.qemu_io(overlay, f"read -P {pattern} {off} {n}", fmt=fmt, extra=["-r"])


def vhdx_bat(image: Path, blocks: list[int]) -> list[tuple[int, int]]:
    """(state, file offset) of the BAT entries of payload blocks `blocks`, as on disk."""
    entries = [vhdx_edit.get_bat(image, vhdx_edit.bat_index(image, b)) for b in blocks]
    return [(e & 7, e & ~(MiB - 1)) for e in entries]


@pytest.mark.parametrize("variant", ["vhdx-dynamic", "vhdx-fixed"])
def test_vhdx_punch_over_whole_blocks(workdir: Path, variant: str) -> None:
    """A punch over whole blocks of a dynamic VHDX makes them PAYLOAD_BLOCK_UNMAPPED
    (state 3, offset 0) and frees their host space (st_blocks goes down); the cut
    blocks at either end stay FULLY_PRESENT where they were, as does every block of
    a fixed VHDX (zeroed in place). A later write of the same mount into an
    unallocated block reuses the freed space (the file does not grow). qemu-img check
    is clean and QEMU reads what the mount showed."""
    fmt, opts, _ = VARIANTS[variant]
    dynamic = variant == "vhdx-dynamic"
    size = 40 * MiB
    image = fh.make_image(workdir, fmt, "p.vhdx", size, ",".join(filter(None, [opts, "block_size=1M"])),
                          ["write -P 0x5a 0 32M"])
    blocks = [3, 4, 5, 6, 7, 8]  # the punch cuts 3 and 8, covers 4-7
    before = vhdx_bat(image, blocks)
    assert all(state == 6 for state, _ in before), before
    allocated = image.stat().st_blocks * 512
    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "view.raw", ["rw", "cache=none", f"format={fmt}"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 3 * MiB + 512, 5 * MiB)
            assert os.pread(fd, 5 * MiB, 3 * MiB + 512) == bytes(5 * MiB), "punched range not zero"
            os.fsync(fd)
            freed = allocated - image.stat().st_blocks * 512
            assert freed >= 4 * MiB, f"the punch freed {freed} bytes of the image file"
            file_size = image.stat().st_size
            assert os.pwrite(fd, b"\x77" * 65536, 36 * MiB + 4096) == 65536
            os.fsync(fd)
            assert image.stat().st_size == file_size, "the write did not reuse the freed space"
        finally:
            os.close(fd)
        shutil.copyfile(m.path, copy)
    after = vhdx_bat(image, blocks)
    if dynamic:
        assert after[1:5] == [(3, 0)] * 4, after
        assert after[0] == before[0] and after[5] == before[5], (before, after)
        state, offset = vhdx_bat(image, [36])[0]
        assert state == 6 and offset in {o for _, o in before[1:5]}, (state, offset, before)
    else:
        assert after == before, (before, after)
    helpers.qemu_img_check(image, fmt)
    reference = helpers.convert_to_raw(image, workdir / "qemu.raw", fmt=fmt)
    assert helpers.files_equal(reference, copy), (
        f"{variant}: qemu-img convert differs from the view at byte "
        f"{helpers.first_difference(reference.read_bytes(), copy.read_bytes())}")
    data = copy.read_bytes()
    assert data[3 * MiB + 512:8 * MiB + 512] == bytes(5 * MiB)
    assert data[36 * MiB:36 * MiB + 4096] == bytes(4096) and data[36 * MiB + 4096:36 * MiB + 69632] == b"\x77" * 65536
    assert data[:3 * MiB + 512] == b"\x5a" * (3 * MiB + 512)


VDI_DISCARDED = 0xFFFFFFFE


def vdi_layout(image: Path) -> tuple[int, int, list[int]]:
    """(offset_data, blocks_allocated, block map entries) of a VDI image, as on disk."""
    raw = image.read_bytes()
    word = lambda at: int.from_bytes(raw[at:at + 4], "little")  # noqa: E731
    offset_bmap, offset_data = word(340), word(344)
    disk_size = int.from_bytes(raw[368:376], "little")
    blocks = (disk_size + MiB - 1) // MiB
    return offset_data, word(388), [word(offset_bmap + 4 * b) for b in range(blocks)]


def test_vdi_punch_over_whole_blocks(workdir: Path) -> None:
    """A punch over whole blocks of a dynamic VDI discards them (VDI_DISCARDED) and moves the last
    data blocks into their place: blocks_allocated drops by their number, the file ends after the
    last allocated block (st_blocks goes down) as soon as the punch returns; the cut blocks at either
    end keep their data blocks. A later write into an unallocated block gets data block
    blocks_allocated, as QEMU allocates. qemu-img check is clean, QEMU reads what the mount showed,
    and so does a remount."""
    size = 40 * MiB
    image = fh.make_image(workdir, "vdi", "p.vdi", size, "", ["write -P 0x5a 0 32M"])
    offset_data, count, entries = vdi_layout(image)
    assert count == 32 and entries[:32] == list(range(32)), (count, entries)
    allocated = image.stat().st_blocks * 512
    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "view.raw", ["rw", "cache=none", "format=vdi"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 3 * MiB + 512, 5 * MiB)  # 4-7 whole
            assert os.pread(fd, 5 * MiB, 3 * MiB + 512) == bytes(5 * MiB), "punched range not zero"
            _, count, entries = vdi_layout(image)
            assert count == 28, count
            assert entries[4:8] == [VDI_DISCARDED] * 4, entries
            assert entries[28:32] == [4, 5, 6, 7], entries  # the last data blocks moved into the freed ones
            assert entries[:4] == [0, 1, 2, 3] and entries[8:28] == list(range(8, 28)), entries
            assert image.stat().st_size == offset_data + 28 * MiB, image.stat().st_size
            freed = allocated - image.stat().st_blocks * 512
            assert freed >= 4 * MiB, f"the punch freed {freed} bytes of the image file"
            assert os.pwrite(fd, b"\x77" * 65536, 36 * MiB + 4096) == 65536
            os.fsync(fd)
            _, count, entries = vdi_layout(image)
            assert count == 29 and entries[36] == 28, (count, entries[36])
        finally:
            os.close(fd)
        shutil.copyfile(m.path, copy)
    helpers.qemu_img_check(image, "vdi")
    reference = helpers.convert_to_raw(image, workdir / "qemu.raw", fmt="vdi")
    assert helpers.files_equal(reference, copy), (
        f"qemu-img convert differs from the view at byte "
        f"{helpers.first_difference(reference.read_bytes(), copy.read_bytes())}")
    data = copy.read_bytes()
    assert data[:3 * MiB + 512] == b"\x5a" * (3 * MiB + 512)
    assert data[3 * MiB + 512:8 * MiB + 512] == bytes(5 * MiB)
    assert data[8 * MiB + 512:32 * MiB] == b"\x5a" * (24 * MiB - 512)
    assert data[36 * MiB:36 * MiB + 4096] == bytes(4096) and data[36 * MiB + 4096:36 * MiB + 69632] == b"\x77" * 65536
    with helpers.mounted(image, workdir / "again.raw", ["format=vdi"]) as m:
        fh.assert_view_equals(m.path, copy, image)


@pytest.mark.parametrize("variant", ["vhdx-dynamic", "vdi-dynamic"])
def test_punches_and_writes_beside_a_verified_write_load(workdir: Path, variant: str) -> None:
    """Threads punch, write, read and fsync their own quarters of the second half of the disk (whole
    blocks unmapped and their space reused (VHDX), or discarded and the last data blocks moved into
    their place (VDI), under load) while fio writes and verifies the first half: fio's data stays
    intact, each quarter reads as its model, the file stays near the disk's size, qemu-img check is
    clean and QEMU reads what the mount showed."""
    fmt, opts, _ = VARIANTS[variant]
    size = 96 * MiB
    image = fh.make_image(workdir, fmt, f"s.{fmt}", size, ",".join(filter(None, [opts, "block_size=1M"]))
                          if fmt == "vhdx" else opts)
    half, quarter = size // 2, size // 8
    model = bytearray(half)
    failures: list[str] = []
    stop = threading.Event()

    def churn(path: Path, index: int) -> None:
        rng = random.Random(index)
        lo = index * quarter
        fd = os.open(path, os.O_RDWR)
        try:
            while not stop.is_set():
                off = rng.randrange(0, quarter - 3 * MiB) & ~511
                n = rng.choice([4096, MiB, 2 * MiB + 4096, 3 * MiB])
                r = rng.random()
                if r < 0.4:
                    data = bytes([rng.randrange(1, 256)]) * n
                    os.pwrite(fd, data, half + lo + off)
                    model[lo + off:lo + off + n] = data
                elif r < 0.7:
                    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, half + lo + off, n)
                    model[lo + off:lo + off + n] = bytes(n)
                elif r < 0.8:
                    os.fsync(fd)
                elif os.pread(fd, n, half + lo + off) != model[lo + off:lo + off + n]:
                    failures.append(f"quarter {index}: {n} bytes at {half + lo + off} differ from the model")
        except OSError as e:
            failures.append(f"quarter {index}: {e}")
        finally:
            os.close(fd)

    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "view.raw", ["rw", "cache=none", f"format={fmt}"]) as m:
        threads = [threading.Thread(target=churn, args=(m.path, i)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            fio_verify(m.path, "--rw=randwrite", "--bsrange=4k-1M", "--offset=0", f"--size={half}", "--direct=1",
                       "--loops=2")
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not failures, failures[:5]
        shutil.copyfile(m.path, copy)
    assert copy.read_bytes()[half:] == model, "the punched and written half differs from the model"
    assert image.stat().st_size < size + 32 * MiB, f"the file grew to {image.stat().st_size}: no space was reused"
    helpers.qemu_img_check(image, fmt)
    reference = helpers.convert_to_raw(image, workdir / "qemu.raw", fmt=fmt)
    assert helpers.files_equal(reference, copy), "qemu-img convert differs from the view"
    if fmt == "vdi":
        offset_data, count, entries = vdi_layout(image)
        named = sorted(e for e in entries if e < VDI_DISCARDED)
        assert named == list(range(count)), "the data blocks are not packed"
        assert image.stat().st_size <= offset_data + count * MiB, "vacated data blocks were not cut off"
