"""VDI images made by qemu-img/qemu-io, read through a read-only mount and
checked against QEMU (format_helpers.check_image: bytes, SEEK_DATA/HOLE, info
and map): dynamic and static images, sizes that are not whole blocks, odd
sizes QEMU rounds up, discarded blocks, and a qcow2 overlay over a VDI base."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers

KiB, MiB = 1 << 10, 1 << 20
BLOCK = MiB
DISK_SIZE_AT = 368
BMAP_OFFSET_AT = 340


def vdi(workdir: Path, name: str, size: int, opts: str = "", seed: int = 1) -> Path:
    return fh.make_image(workdir, "vdi", name, size, opts, fh.scattered_writes(size, BLOCK, seed))


@pytest.mark.parametrize("opts,size", [
    ("", 32 * MiB),
    ("static=on", 16 * MiB),
    ("", 20 * MiB + 3 * 512),
    ("static=on", 9 * MiB + 64 * KiB),
], ids=["dynamic", "static", "dynamic_partial_block", "static_partial_block"])
def test_variants_read_as_qemu_reads_them(workdir: Path, opts: str, size: int) -> None:
    image = vdi(workdir, "disk.vdi", size, opts)
    fh.check_image(image, workdir, fmt="vdi")


def test_fresh_image_is_present_zero(workdir: Path) -> None:
    """QEMU reports unallocated VDI blocks as present zeros, not as holes."""
    image = fh.make_image(workdir, "vdi", "fresh.vdi", 16 * MiB)
    assert helpers.qemu_img_map(image, fmt="vdi")[0]["present"] is True
    fh.check_image(image, workdir, fmt="vdi")


def test_direct_io(workdir: Path) -> None:
    image = vdi(workdir, "direct.vdi", 24 * MiB, seed=5)
    fh.check_image_direct(image, workdir, fmt="vdi")


def test_odd_disk_size_is_rounded_up_to_a_sector(workdir: Path) -> None:
    """VBoxManage convertfromraw writes odd sizes; QEMU rounds up to 512 bytes."""
    image = vdi(workdir, "odd.vdi", 12 * MiB)
    with open(image, "r+b") as f:
        f.seek(DISK_SIZE_AT)
        f.write(struct.pack("<Q", 11 * MiB + 100))
    assert helpers.qemu_img_info(image, fmt="vdi")["virtual-size"] == 11 * MiB + 512
    fh.check_image(image, workdir, fmt="vdi")


def test_discarded_blocks_read_as_zeros(workdir: Path) -> None:
    """Block map entry 0xfffffffe (discarded) reads as zeros, like unallocated."""
    image = fh.make_image(workdir, "vdi", "disc.vdi", 8 * MiB, "",
                          ["write -P 0x21 0 3M", "write -P 0x22 5M 1M"])
    with open(image, "r+b") as f:
        f.seek(BMAP_OFFSET_AT)
        bmap = struct.unpack("<I", f.read(4))[0]
        f.seek(bmap + 4)  # block 1
        f.write(struct.pack("<I", 0xFFFFFFFE))
    fh.check_image(image, workdir, fmt="vdi")


def test_cross_format_chain_qcow2_over_vdi(workdir: Path) -> None:
    base = vdi(workdir, "base.vdi", 24 * MiB, seed=7)
    top = workdir / "top.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base.name, "-F", "vdi", top, str(32 * MiB)])
    helpers.qemu_io(top, "write -P 0x81 1M 64k", "write -z 3M 1M", "write -P 0x82 23M 2M", fmt="qcow2")
    reference = helpers.convert_to_raw(top, workdir / "top.ref.raw")
    with helpers.mounted(top, workdir / "view") as m:
        assert helpers.files_equal(m.path, reference)
    fh.assert_map_matches(top)
