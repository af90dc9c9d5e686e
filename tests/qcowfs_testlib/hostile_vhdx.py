"""Hostile VHDX images for the corpus (tests/qcowfs_testlib/hostile.py loads cases()).

Each case starts from a 16 MiB qemu-img VHDX with 1 MiB blocks and data in
blocks 0, 3 and 9, and damages one structure with vhdx_edit.py (checksums are
recomputed where the damage is meant to pass them). Outcomes follow QEMU 7.2:
what it refuses is refused; what it reads as zeros is Readable; BAT states it
fails reads on are EIO. Two refusals are qcowfs's own limits (virtual sizes
over 64 TiB, where QEMU's uint32 block count wraps; see image/vhdx/DESIGN.md).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from qcowfs_testlib import vhdx_edit as ed

MiB = 1 << 20
WRITES = ("write -P 0x11 0 1M", "write -P 0x22 3M 64k", "write -P 0x33 9M 2M")


def base(h, d: Path) -> Path:
    img = d / "img.vhdx"
    h.run("qemu-img", "create", "-q", "-f", "vhdx", "-o", "block_size=1M,block_state_zero=off", img, "16M")
    args = ["qemu-io", "-f", "vhdx"]
    for c in WRITES:
        args += ["-c", c]
    h.run(*args, img)
    return img


def recipe(h, damage, pristine: bool = False):
    def make(d: Path):
        img = base(h, d)
        raw = h.to_raw(img, d / "pristine.raw", "vhdx") if pristine else None
        damage(img)
        return h.Built(img, [img], raw, {"format": "vhdx"})
    return make


def both_headers_bad(img: Path) -> None:
    ed.corrupt_header_checksum(img, 0)
    ed.corrupt_header_checksum(img, 1)


def block_size(value: int):
    return lambda img: ed.set_metadata_u32(img, ed.FILE_PARAMETERS_GUID, value)


def bat_state(index: int, state: int, offset: int | None = None):
    def damage(img: Path) -> None:
        old = ed.get_bat(img, index)
        ed.set_bat(img, index, ed.bat_entry(state, old if offset is None else offset))
    return damage


def pending_log(img: Path) -> None:
    ed.write_pending_log(img, [((ed.get_bat(img, 0) & ~(MiB - 1)) + 8192, bytes([0x77]) * 4096)])


def log_guid_only(img: Path) -> None:
    ed.set_header_fields(img, ed.current_header_index(img), log_guid=uuid.uuid4().bytes_le)


def cases(h) -> dict:
    Case, Refused, Eio, Readable = h.Case, h.Refused, h.Eio, h.Readable
    return {
        "vhdx_both_headers_bad_checksum": Case(
            recipe(h, both_headers_bad), Refused("no valid VHDX header"), "both header checksums wrong"),
        "vhdx_metadata_region_past_eof": Case(
            recipe(h, lambda img: ed.set_region_entry(img, ed.METADATA_GUID, file_offset=1 << 40)),
            Refused("metadata"), "region table puts the metadata 1 TiB past the end of the file"),
        "vhdx_bat_region_past_eof": Case(
            recipe(h, lambda img: ed.set_region_entry(img, ed.BAT_GUID, file_offset=1 << 40)),
            Readable(), "BAT region past the end of the file: QEMU reads zeros (all blocks NOT_PRESENT)"),
        "vhdx_block_size_not_power_of_two": Case(
            recipe(h, block_size(3 * MiB)), Refused("block size"), "3 MiB blocks"),
        "vhdx_block_size_too_large": Case(
            recipe(h, block_size(512 * MiB)), Refused("block size"), "512 MiB blocks"),
        "vhdx_bat_region_too_small": Case(
            recipe(h, lambda img: ed.set_region_entry(img, ed.BAT_GUID, length=64)),
            Refused("too small"), "64-byte BAT region for 16 blocks"),
        "vhdx_bat_entry_past_eof": Case(
            recipe(h, bat_state(3, ed.STATE_FULLY_PRESENT, 1 << 40)), Refused("beyond the end of the file"),
            "FULLY_PRESENT block 1 TiB past the end of the file"),
        "vhdx_bat_entry_into_metadata": Case(
            recipe(h, lambda img: bat_state(3, ed.STATE_FULLY_PRESENT, ed.metadata_offset(img))(img)),
            Refused("overlaps"), "payload block on top of the metadata region"),
        "vhdx_virtual_size_wraps_block_count": Case(
            recipe(h, lambda img: ed.set_metadata_u64(img, ed.VIRTUAL_DISK_SIZE_GUID, (1 << 52) + 16 * MiB)),
            Refused("64 TiB"), "4 PiB + 16 MiB: QEMU's uint32 block count wraps to 16"),
        "vhdx_log_needs_replay": Case(
            recipe(h, pending_log), Refused("needs to be replayed"), "valid log entry in the current header's log"),
        "vhdx_log_guid_without_entries": Case(
            recipe(h, log_guid_only), Readable(), "non-zero log GUID, no valid entry: QEMU opens it"),
        "vhdx_has_parent": Case(
            recipe(h, lambda img: ed.set_metadata_u32(img, ed.FILE_PARAMETERS_GUID, 2, at=4)),
            Refused("has_parent"), "differencing flag without a parent locator"),
        "vhdx_partially_present_block": Case(
            recipe(h, bat_state(0, ed.STATE_PARTIALLY_PRESENT), pristine=True),
            Eio(bad=((0, 4096), (512 * 1024, 512)), good=((MiB, 2 * MiB), (9 * MiB, MiB))),
            "PARTIALLY_PRESENT (differencing only): QEMU's reads fail with EIO"),
        "vhdx_block_in_header_section": Case(
            recipe(h, bat_state(3, ed.STATE_FULLY_PRESENT, 0), pristine=True),
            Eio(bad=((3 * MiB, 4096),), good=((0, MiB), (9 * MiB, 2 * MiB))),
            "FULLY_PRESENT at file offset 0 (QEMU reads the file header there, per request)"),
    }
