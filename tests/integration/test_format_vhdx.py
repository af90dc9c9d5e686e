"""VHDX images made by qemu-img/qemu-io, mounted read-only and compared with
QEMU (format_helpers.check_image): bytes, SEEK_DATA/SEEK_HOLE, info and map.

QEMU 7.2's vhdx driver has no block-status callback, so `qemu-img map` shows
the whole disk as one data range without offsets: every variant checks that
qcowfs map and SEEK_DATA/SEEK_HOLE say the same. Variants: dynamic and fixed,
block sizes 1, 8 (default), 32 and 256 MiB, block_state_zero on/off, a 2 MiB
log, BAT states UNDEFINED/UNMAPPED written by hand (QEMU reads zeros), a log
replayed by `qemu-img check -r all`, a qcow2 overlay over a VHDX base, and
refusals: a read-only mount of a log that needs replaying, 4096-byte logical
sectors (QEMU 7.2 refuses them too).

Read-write (the writes themselves: test_rw_formats.py, test_model_check.py,
tests/unit/vhdx/vhdx_write_test.cc): a read-write mount replays a pending log as
QEMU would, and refuses, untouched, an image whose BAT names one block twice.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from qcowfs_testlib import helpers
from qcowfs_testlib.format_helpers import MiB, check_image, check_image_direct, make_image, scattered_writes


from qcowfs_testlib import vhdx_edit as ed

# name: (virtual size, create options, block size used for the writes)
VARIANTS = {
    "dynamic_1m": (24 * MiB, "block_size=1M", 1 * MiB),
    "dynamic_default_block": (40 * MiB, "", 8 * MiB),
    "dynamic_32m_no_zero_state": (96 * MiB, "block_size=32M,block_state_zero=off", 32 * MiB),
    "dynamic_256m": (300 * MiB, "block_size=256M", 256 * MiB),
    "fixed_present": (16 * MiB, "subformat=fixed,block_size=1M,block_state_zero=off", 1 * MiB),
    "fixed_zero_state": (16 * MiB, "subformat=fixed,block_size=2M", 2 * MiB),
    "dynamic_log_2m": (16 * MiB, "block_size=1M,log_size=2M", 1 * MiB),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_reads_as_qemu(workdir: Path, name: str) -> None:
    size, opts, block = VARIANTS[name]
    image = make_image(workdir, "vhdx", f"{name}.vhdx", size, opts, scattered_writes(size, block))
    check_image(image, workdir, fmt="vhdx")


def test_empty_fixed_image_and_cluster_size(workdir: Path) -> None:
    image = make_image(workdir, "vhdx", "empty.vhdx", 8 * MiB, "subformat=fixed,block_size=1M,block_state_zero=off")
    assert helpers.qemu_img_info(image, fmt="vhdx")["cluster-size"] == MiB
    check_image(image, workdir, fmt="vhdx")


def base_1m(workdir: Path, name: str = "base.vhdx") -> Path:
    return make_image(workdir, "vhdx", name, 16 * MiB, "block_size=1M,block_state_zero=off",
                      ["write -P 0x11 0 1M", "write -P 0x22 3M 64k", "write -P 0x33 9M 2M"])


def test_undefined_and_unmapped_blocks_read_as_zeros(workdir: Path) -> None:
    image = base_1m(workdir)
    for index, state in ((0, ed.STATE_UNDEFINED), (3, ed.STATE_UNMAPPED), (9, 5)):
        ed.set_bat(image, index, ed.get_bat(image, index) & ~7 | state)
    check_image(image, workdir, fmt="vhdx")


def test_direct_io_through_a_4k_host(workdir: Path) -> None:
    image = make_image(workdir, "vhdx", "d.vhdx", 16 * MiB, "block_size=1M", scattered_writes(16 * MiB, MiB))
    check_image_direct(image, workdir, fmt="vhdx")


def test_qcow2_overlay_over_a_vhdx_base(workdir: Path) -> None:
    base = base_1m(workdir)
    top = workdir / "top.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base.name, "-F", "vhdx", top, "16M"])
    helpers.qemu_io(top, "write -P 0x44 1M 1M", "write -z 9M 64k", fmt="qcow2")
    check_image(top, workdir)


def test_replayed_log_reads_the_logged_data(workdir: Path) -> None:
    image = base_1m(workdir)
    block0 = ed.get_bat(image, 0) & ~(MiB - 1)
    ed.write_pending_log(image, [(block0 + 8192, bytes([0x77]) * 4096)])
    helpers.run(["qemu-img", "check", "-q", "-r", "all", image])
    assert helpers.qemu_img_info(image, fmt="vhdx")["format"] == "vhdx"
    check_image(image, workdir, fmt="vhdx")


def test_read_write_mount_of_overlapping_blocks_is_refused(workdir: Path) -> None:
    image = base_1m(workdir)
    ed.set_bat(image, 5, ed.get_bat(image, 0))  # a new block could not tell them apart
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view.raw", ["rw"])
    assert "mount it read-only" in text and "overlapping" in text, text
    assert helpers.sha256_file(image) == before
    check_image(image, workdir, fmt="vhdx")  # read-only as before


def test_read_write_mount_replays_a_pending_log_as_qemu_does(workdir: Path) -> None:
    image = base_1m(workdir)
    block0 = ed.get_bat(image, 0) & ~(MiB - 1)
    ed.write_pending_log(image, [(block0 + 8192, bytes([0x77]) * 4096)])
    theirs = workdir / "theirs.vhdx"
    theirs.write_bytes(image.read_bytes())
    helpers.run(["qemu-img", "check", "-q", "-r", "all", theirs])
    with helpers.mounted(image, workdir / "view.raw", ["rw"]) as m:
        with open(m.path, "rb") as f:
            f.seek(8192)
            assert f.read(4096) == bytes([0x77]) * 4096
    helpers.qemu_img_check(image, "vhdx")  # opens read-only: the log is empty now
    ours = helpers.convert_to_raw(image, workdir / "ours.raw", fmt="vhdx").read_bytes()
    assert ours == helpers.convert_to_raw(theirs, workdir / "theirs.raw", fmt="vhdx").read_bytes()


def test_log_that_needs_replay_is_refused(workdir: Path) -> None:
    image = base_1m(workdir)
    ed.write_pending_log(image, [(3 * MiB, bytes(4096))])
    qemu = helpers.run(["qemu-img", "info", image], check=False)
    assert qemu.returncode != 0 and b"needs to be replayed" in qemu.stderr
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view.raw")
    assert "contains a log that needs to be replayed" in text and "qemu-img check -r all" in text, text
    assert helpers.sha256_file(image) == before


def test_log_guid_without_entries_opens_as_in_qemu(workdir: Path) -> None:
    image = base_1m(workdir)
    ed.set_header_fields(image, ed.current_header_index(image), log_guid=uuid.uuid4().bytes_le)
    check_image(image, workdir, fmt="vhdx")


def test_logical_sector_size_4096_is_refused_as_in_qemu(workdir: Path) -> None:
    """qemu-img cannot create one; QEMU 7.2 refuses to open one (ENOTSUP)."""
    image = base_1m(workdir)
    ed.set_metadata_u32(image, ed.LOGICAL_SECTOR_GUID, 4096)
    assert helpers.run(["qemu-img", "info", image], check=False).returncode != 0
    code, text = helpers.mount_fails(image, workdir / "view.raw")
    assert "logical sector size 4096" in text, text
