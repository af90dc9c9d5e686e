"""A FIFO, a directory, a unix socket or a character device where an image
names a file (issue 31, item 3): as the image itself, a VMDK monolithicFlat
extent, a qcow2 or QED backing file, a VMDK delta's parent (parentFileNameHint)
and a qcow2 external data file. A plain open(2) of a FIFO without a writer
blocks for ever; qcowfs must refuse each of these at once, with a non-zero exit
and a message naming the file and what it is, in the mount and in every tool
that opens the file.

What each tool opens follows qemu-img: `info` opens neither the backing file
nor the data file (it only prints their names; `info --backing-chain` opens the
chain), so those runs succeed and only have to be quick; `check` opens the
backing chain and data file as qemu-img check does, and so refuses a non-file
there. The acceptance says "within a second"; the bound asserted is
3 s, generous for a loaded machine, with a 10 s timeout so that a hang fails
the test instead of stalling it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
BOUND_S = 3.0  # acceptance: one second; generous for loaded machines
KINDS = {"fifo": "a FIFO", "directory": "a directory", "socket": "a socket", "chardev": "a character device"}
ROLES = ("image", "extent", "qcow2-backing", "qed-backing", "vmdk-parent", "data-file")


def make_non_file(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(path))  # the socket file stays after close
    else:
        path.symlink_to("/dev/zero")  # opened through the name the image gives


def qemu_img(d: Path, *args) -> None:
    """qemu-img run in d: it creates a relative data_file= relative to its working directory."""
    subprocess.run(["qemu-img", *[str(a) for a in args]], cwd=d, check=True, timeout=60)


def build(role: str, d: Path) -> tuple[Path, Path]:
    """(the image to open, the file that becomes a non-file) for role."""
    if role == "image":
        return d / "disk.qcow2", d / "disk.qcow2"
    if role == "extent":
        (d / "d.vmdk").write_text('# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n'
                                  'createType="monolithicFlat"\nRW 2048 FLAT "extent.raw" 0\n')
        return d / "d.vmdk", d / "extent.raw"
    if role in ("qcow2-backing", "qed-backing"):
        fmt = role.split("-")[0]
        image = d / f"top.{fmt}"
        qemu_img(d, "create", "-q", "-f", fmt, "-u", "-b", "base.raw", "-F", "raw", image, str(MiB))
        return image, d / "base.raw"
    if role == "vmdk-parent":
        qemu_img(d, "create", "-q", "-f", "vmdk", d / "parent.vmdk", str(MiB))
        qemu_img(d, "create", "-q", "-f", "vmdk", "-b", "parent.vmdk", "-F", "vmdk", d / "delta.vmdk")
        assert b'parentFileNameHint="parent.vmdk"' in (d / "delta.vmdk").read_bytes()
        return d / "delta.vmdk", d / "parent.vmdk"
    assert role == "data-file"
    qemu_img(d, "create", "-q", "-f", "qcow2", "-o", "data_file=data.raw", "dq.qcow2", str(MiB))
    assert (d / "data.raw").is_file()
    return d / "dq.qcow2", d / "data.raw"


def timed(argv: list) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=10)
    return proc.returncode, (proc.stderr + proc.stdout).decode(errors="replace"), time.monotonic() - start


def assert_refused(rc: int, text: str, elapsed: float, target: Path, kind: str, what: str) -> None:
    assert elapsed < BOUND_S, f"{what}: took {elapsed:.1f}s"
    assert rc != 0, f"{what}: exit 0\n{text}"
    # The mount names the image by its real path (a symbolic link to /dev/zero as /dev/zero).
    names = {str(target), os.path.realpath(target)}
    assert any(f"{n} is {KINDS[kind]}, not a regular file or block device" in text for n in names), \
        f"{what}:\n{text}"


# What each tool does with a non-file in role, when it does not refuse it
# (see the module docstring): the expected exit code.
NOT_OPENED = {
    ("info", "qcow2-backing"): 0, ("info", "qed-backing"): 0, ("info", "vmdk-parent"): 0,
    ("info", "data-file"): 0,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role", ROLES)
def test_non_file_is_refused_at_once(workdir: Path, qcowfs: str, role: str, kind: str) -> None:
    image, target = build(role, workdir)
    make_non_file(target, kind)

    start = time.monotonic()
    _, text = helpers.mount_fails(image, workdir / "mnt")  # -f; non-zero exit, nothing mounted
    if (role, kind) == ("image", "directory"):
        # A directory as IMAGE is a catalogue mount (a directory of images, README "Many images,
        # one daemon"): refused at once here because the mount point is a file, not a directory.
        assert time.monotonic() - start < BOUND_S
        assert "a directory of images is mounted on a directory" in text, text
    else:
        assert_refused(1, text, time.monotonic() - start, target, kind, "mount")

    for tool in ("info", "map", "check"):
        rc, text, elapsed = timed([qcowfs, tool, image])
        expected = NOT_OPENED.get((tool, role))
        if expected is None:
            assert_refused(rc, text, elapsed, target, kind, tool)
        else:
            assert elapsed < BOUND_S, f"{tool}: took {elapsed:.1f}s"
            assert rc == expected, f"{tool}: exit {rc}, expected {expected}\n{text}"

    if role.endswith(("-backing", "-parent")):
        rc, text, elapsed = timed([qcowfs, "info", "--backing-chain", image])
        assert_refused(rc, text, elapsed, target, kind, "info --backing-chain")
