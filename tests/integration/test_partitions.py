"""Inspection mode: DIR/partitions/pN.raw, one window per partition.

Disks are partitioned with sfdisk (MBR with an extended partition holding
logical ones, and GPT), file systems are made with mkfs.ext4 and mkfs.vfat on
the partition files through the mount and checked with e2fsck / fsck.vfat on
the partition files; qemu-img convert then shows the same bytes at the
partition offsets. The listing follows the table after writes (re-read on
opendir).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
MBR_SCRIPT = "label: dos\n,16M,L\n,,E\n,20M,L\n,,L\n"  # p1, extended p2 holding p5 and p6
GPT_SCRIPT = "label: gpt\n,12M,L\n,24M,L\n,,L\n"
MBR_PARTS = {1: "vfat", 5: "ext4", 6: "ext4"}
GPT_PARTS = {1: "vfat", 2: "ext4", 3: "vfat"}


def sfdisk(target: Path, script: str) -> None:
    helpers.run(["sfdisk", "-q", "--no-reread", "--no-tell-kernel", target], input=script.encode())


def layout(disk: Path) -> dict[int, tuple[int, int]]:
    """{partition number: (offset, size)} as sfdisk reads them, containers left out."""
    table = json.loads(helpers.run(["sfdisk", "-J", disk]).stdout)["partitiontable"]
    out = {}
    for p in table["partitions"]:
        number = int(p["node"].rsplit(str(disk.name), 1)[1].lstrip("p") or 0)
        if p.get("type") in ("5", "f", "85"):
            continue
        out[number] = (p["start"] * 512, p["size"] * 512)
    return out


def mkfs(part: Path, kind: str) -> None:
    if kind == "ext4":
        helpers.run(["mkfs.ext4", "-q", "-F", "-L", f"p{part.stem}", part])
    else:
        helpers.run(["mkfs.vfat", part])


def fsck(part: Path, kind: str) -> None:
    if kind == "ext4":
        helpers.run(["e2fsck", "-fn", part])
    else:
        helpers.run(["fsck.vfat", "-n", part])


def listing(m: helpers.Mount) -> list[str]:
    return sorted(os.listdir(m.target / "partitions"))


def assert_windows_match(m: helpers.Mount, disk_bytes: Path, parts: dict[int, tuple[int, int]]) -> None:
    """Each pN.raw holds exactly the bytes at its offset in the (converted) disk."""
    for n, (offset, size) in parts.items():
        p = m.target / "partitions" / f"p{n}.raw"
        assert p.stat().st_size == size, p
        with open(p, "rb") as a, open(disk_bytes, "rb") as b:
            b.seek(offset)
            left = size
            while left:
                chunk = min(left, 4 * MiB)
                assert a.read(chunk) == b.read(chunk), f"p{n}.raw differs from the disk at {offset + size - left}"
                left -= chunk


def make_disk(workdir: Path, fmt: str) -> Path:
    if fmt == "raw":
        disk = workdir / "disk.raw"
        disk.write_bytes(b"")
        os.truncate(disk, 64 * MiB)
    else:
        disk = workdir / "disk.qcow2"
        helpers.qemu_img("create", "-q", "-f", "qcow2", disk, "64M")
    return disk


@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
@pytest.mark.parametrize("scheme", ["mbr", "gpt"])
def test_partition_and_format_through_the_mount(workdir: Path, fmt: str, scheme: str) -> None:
    script, kinds = (MBR_SCRIPT, MBR_PARTS) if scheme == "mbr" else (GPT_SCRIPT, GPT_PARTS)
    disk = make_disk(workdir, fmt)
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(disk, mnt, ["rw"]) as m:
        assert listing(m) == [], "a blank disk has no partitions"
        sfdisk(m.path, script)
        assert listing(m) == sorted(f"p{n}.raw" for n in kinds), "the table is re-read on opendir"
        for n, kind in kinds.items():
            mkfs(m.target / "partitions" / f"p{n}.raw", kind)
        for n, kind in kinds.items():
            fsck(m.target / "partitions" / f"p{n}.raw", kind)
    if fmt == "qcow2":
        helpers.qemu_img_check(disk)
    converted = helpers.convert_to_raw(disk, workdir / "converted.raw")
    parts = layout(converted)
    assert sorted(parts) == sorted(kinds)
    for n, kind in kinds.items():  # the file systems are where sfdisk says, for any reader
        (workdir / f"p{n}").write_bytes(b"")
        helpers.run(["dd", f"if={converted}", f"of={workdir / f'p{n}'}", "bs=512",
                     f"skip={parts[n][0] // 512}", f"count={parts[n][1] // 512}", "status=none"])
        fsck(workdir / f"p{n}", kind)
    with helpers.mounted(disk, mnt) as m:
        assert listing(m) == sorted(f"p{n}.raw" for n in kinds)
        assert_windows_match(m, converted, parts)


def test_read_only_disk_has_read_only_partitions(workdir: Path) -> None:
    raw = workdir / "src.raw"
    raw.write_bytes(b"")
    os.truncate(raw, 48 * MiB)
    sfdisk(raw, "label: dos\n,8M,c\n,,E\n,8M,L\n")
    helpers.run(["mkfs.vfat", "--offset", "2048", raw, str(8 * 1024)])
    disk = workdir / "disk.qcow2"
    helpers.qemu_img("convert", "-f", "raw", "-O", "qcow2", raw, disk)
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(disk, mnt) as m:
        assert listing(m) == ["p1.raw", "p5.raw"]
        p1 = m.target / "partitions" / "p1.raw"
        assert p1.stat().st_mode & 0o777 == 0o444
        fsck(p1, "vfat")
        assert_windows_match(m, raw, layout(raw))
        with pytest.raises(OSError) as e:
            with open(p1, "r+b") as f:
                f.write(b"x")
        assert e.value.errno == errno.EROFS
        assert b"FAT" in helpers.run(["file", "-s", "-L", p1]).stdout


def test_writes_to_a_partition_land_at_its_offset(workdir: Path) -> None:
    disk = make_disk(workdir, "raw")
    sfdisk(disk, "label: dos\n,4M,L\n,,E\n,4M,L\n,4M,L\n")
    parts = layout(disk)
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(disk, mnt, ["rw"]) as m:
        p6 = m.target / "partitions" / "p6.raw"
        with open(p6, "r+b", buffering=0) as f:
            f.write(b"\xab" * 4096)
            f.seek(parts[6][1] - 512)
            f.write(b"\xcd" * 512)
            f.seek(parts[6][1])
            with pytest.raises(OSError) as e:
                f.write(b"past the end")
            assert e.value.errno == errno.ENOSPC
        assert os.path.getsize(p6) == parts[6][1], "a partition file cannot grow"
    data = disk.read_bytes()
    off, size = parts[6]
    assert data[off:off + 4096] == b"\xab" * 4096
    assert data[off + size - 512:off + size] == b"\xcd" * 512
    assert data[off + size:off + size + 12] != b"past the end"


def test_repartitioning_is_followed(workdir: Path) -> None:
    disk = make_disk(workdir, "raw")
    sfdisk(disk, "label: dos\n,8M,L\n,8M,L\n")
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(disk, mnt, ["rw"]) as m:
        assert listing(m) == ["p1.raw", "p2.raw"]
        sfdisk(m.path, "label: gpt\n,4M,L\n,4M,L\n,4M,L\n,4M,L\n")
        assert listing(m) == ["p1.raw", "p2.raw", "p3.raw", "p4.raw"]
        with open(m.path, "r+b") as f:  # wipe the protective MBR signature: no table at all
            f.seek(510)
            f.write(b"\0\0")
        assert listing(m) == []


def test_file_mode_has_no_partition_directory(workdir: Path) -> None:
    disk = make_disk(workdir, "raw")
    sfdisk(disk, "label: dos\n,8M,L\n")
    target = workdir / "view.raw"
    with helpers.mounted(disk, target) as m:
        assert m.path.stat().st_size == 64 * MiB
        assert not (workdir / "partitions").exists()
