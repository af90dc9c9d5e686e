"""mount(8) integration: `mount -t fuse.qcowfs` / fstab entries go through
mount.fuse3, which runs `qcowfs IMAGE MOUNTPOINT -o OPTIONS`. mount(8) runs
helpers with a fixed PATH, so with the binary under test (not installed) the
`-t fuse` form naming the program (`PROGRAM#IMAGE`) is used; test_package.py
covers `-t fuse.qcowfs` with the installed /usr/bin/qcowfs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from qcowfs_testlib import helpers

MiB = 1 << 20


def mount(args: list[str]) -> None:
    helpers.run(["mount", *args])


def umount(target: Path) -> None:
    helpers.run(["umount", target])
    deadline = time.monotonic() + 10
    while helpers.is_fuse_mounted(target) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not helpers.is_fuse_mounted(target)


def make_image(workdir: Path) -> Path:
    img = workdir / "disk.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, "16M")
    helpers.qemu_io(img, "write -P 0x61 1M 64k")
    return img


def test_mount_t_fuse_with_program(workdir: Path, qcowfs: str) -> None:
    img = make_image(workdir)
    mnt = workdir / "mnt"
    mnt.mkdir()
    mount(["-t", "fuse", f"{qcowfs}#{img}", str(mnt), "-o", "ro,nosuid,nodev,cache=writeback,queues=2"])
    try:
        assert helpers.is_fuse_mounted(mnt)
        view = mnt / "disk.raw"
        assert view.stat().st_size == 16 * MiB
        with open(view, "rb") as f:
            f.seek(1 * MiB)
            assert f.read(65536) == b"\x61" * 65536
        line = next(l for l in Path("/proc/mounts").read_text().splitlines() if f" {mnt} " in l)
        assert " fuse.qcowfs " in line and " ro," in line
    finally:
        umount(mnt)


def test_fstab_entry(workdir: Path, qcowfs: str) -> None:
    img = make_image(workdir)
    mnt = workdir / "mnt"
    mnt.mkdir()
    fstab = workdir / "fstab"
    fstab.write_text(f"{qcowfs}#{img}  {mnt}  fuse  defaults,noatime,ro,noauto,nofail,_netdev,x-systemd.automount  0  0\n")
    mount(["-T", str(fstab), str(mnt)])
    try:
        line = next(l for l in Path("/proc/mounts").read_text().splitlines() if f" {mnt} " in l)
        assert " ro," in line
        with open(mnt / "disk.raw", "rb") as f:
            f.seek(1 * MiB)
            assert f.read(4096) == b"\x61" * 4096
    finally:
        umount(mnt)


def test_mount_raw_read_write(workdir: Path, qcowfs: str) -> None:
    img = workdir / "disk.img"
    img.write_bytes(b"")
    os.truncate(img, 8 * MiB)
    target = workdir / "view"
    target.write_bytes(b"")
    mount(["-t", "fuse", f"{qcowfs}#{img}", str(target), "-o", "rw,format=raw"])
    try:
        with open(target, "r+b") as f:
            f.seek(4096)
            f.write(b"written through mount(8)")
    finally:
        umount(target)
    assert img.read_bytes()[4096:4096 + 24] == b"written through mount(8)"


def test_bad_option_fails_the_mount(workdir: Path, qcowfs: str) -> None:
    img = make_image(workdir)
    mnt = workdir / "mnt"
    mnt.mkdir()
    proc = helpers.run(["mount", "-t", "fuse", f"{qcowfs}#{img}", str(mnt), "-o", "cache=sometimes"], check=False)
    assert proc.returncode != 0
    assert not helpers.is_fuse_mounted(mnt)
