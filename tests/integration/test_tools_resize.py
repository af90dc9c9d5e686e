"""`qcowfs resize` against `qemu-img resize` (QEMU 7.2).

Both tools resize copies of the same image with the same arguments; the
results must have the same virtual size (qemu-img info), pass qemu-img
check, and read back the same bytes (qemu-img compare). Where qemu-img
refuses (a shrink without --shrink, a size that is not a size, a format
QEMU cannot resize) qcowfs refuses too, with exit 1 and the file unchanged.
qcowfs differs on purpose in one place: a shrink over data is refused
(qemu-img --shrink drops the data), a shrink over holes is done.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20


def qcowfs_resize(*args) -> subprocess.CompletedProcess:
    return helpers.run([helpers.qcowfs_bin(), "resize", *args], check=False)


def qemu_resize(*args) -> subprocess.CompletedProcess:
    return helpers.run(["qemu-img", "resize", *args], check=False)


def virtual_size(image: Path) -> int:
    return helpers.qemu_img_info(image)["virtual-size"]


def image_with_data(workdir: Path, fmt: str) -> Path:
    image = workdir / f"disk.{fmt}"
    helpers.run(["qemu-img", "create", "-q", "-f", fmt, image, "64M"])
    helpers.qemu_io(image, "write -P 0x5a 1M 2M", "write -P 0xa5 40M 64k", fmt=fmt)
    return image


@pytest.mark.parametrize("fmt", ["qcow2", "qed", "raw"])
@pytest.mark.parametrize("size", ["96M", "+8M", "100000K"])
def test_grow_matches_qemu_img(workdir, fmt, size):
    ours = image_with_data(workdir, fmt)
    theirs = workdir / f"qemu.{fmt}"
    shutil.copyfile(ours, theirs)
    r = qcowfs_resize("-f", fmt, ours, size)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == "Image resized.\n"
    assert qemu_resize("-f", fmt, theirs, size).returncode == 0
    assert virtual_size(ours) == virtual_size(theirs)
    if fmt != "raw":
        assert helpers.qemu_img_check(ours, fmt)["check-errors"] == 0
        helpers.run(["qemu-img", "check", "-q", "-f", fmt, ours])
    helpers.run(["qemu-img", "compare", "-q", "-f", fmt, "-F", fmt, ours, theirs])


@pytest.mark.parametrize("fmt", ["qcow2", "raw"])
def test_shrink_needs_the_flag_like_qemu_img(workdir, fmt):
    image = image_with_data(workdir, fmt)
    before = helpers.sha256_file(image)
    ours = qcowfs_resize("-f", fmt, image, "48M")
    theirs = qemu_resize("-f", fmt, image, "48M")
    assert ours.returncode == theirs.returncode == 1
    assert "Use the --shrink option to perform a shrink operation." in ours.stderr.decode()
    assert helpers.sha256_file(image) == before


def test_shrink_over_holes_is_done_and_over_data_refused(workdir):
    image = image_with_data(workdir, "qcow2")
    expected = workdir / "expected.raw"
    helpers.convert_to_raw(image, expected)
    before = helpers.sha256_file(image)
    r = qcowfs_resize("--shrink", image, "40M")  # 40M..40M+64k holds data
    assert r.returncode == 1
    assert "holds data" in r.stderr.decode()
    assert helpers.sha256_file(image) == before
    r = qcowfs_resize("--shrink", image, "-" + "16M")  # relative, the last argument even if it starts with '-'
    assert r.returncode == 0, r.stderr.decode()
    assert virtual_size(image) == 48 * MiB
    helpers.run(["qemu-img", "check", "-q", image])
    with open(expected, "r+b") as f:
        f.truncate(48 * MiB)
    helpers.run(["qemu-img", "compare", "-q", "-f", "qcow2", "-F", "raw", image, expected])


@pytest.mark.parametrize("fmt", ["vdi", "vpc", "vhdx"])
def test_formats_qemu_cannot_resize_are_refused(workdir, fmt):
    image = workdir / f"disk.{fmt}"
    helpers.run(["qemu-img", "create", "-q", "-f", fmt, image, "64M"])
    before = helpers.sha256_file(image)
    assert qemu_resize(image, "128M").returncode == 1
    r = qcowfs_resize(image, "128M")
    assert r.returncode == 1
    assert "cannot be resized" in r.stderr.decode()
    assert helpers.sha256_file(image) == before


@pytest.mark.parametrize("size", ["abc", "-", "0", "-64M"])
def test_bad_sizes_are_refused(workdir, size):
    image = image_with_data(workdir, "qcow2")
    before = helpers.sha256_file(image)
    r = qcowfs_resize("--shrink", image, size)
    assert r.returncode == 1
    assert qemu_resize("--shrink", image, size).returncode == 1
    assert helpers.sha256_file(image) == before


def test_an_image_in_use_is_refused_and_left_alone(workdir):
    image = image_with_data(workdir, "qcow2")
    with helpers.mounted(image, workdir / "view.raw", ["rw"]):
        before = helpers.sha256_file(image)
        r = qcowfs_resize(image, "+1M")
        assert r.returncode == 1
        assert 'failed to get "write" lock' in r.stderr.decode()
        assert helpers.sha256_file(image) == before
    assert virtual_size(image) == 64 * MiB
