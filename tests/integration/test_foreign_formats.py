"""Images of formats qcowfs recognises but does not read (qcow version 1), made by qemu-img: the mount is refused with a message
naming the format and leaves the file untouched; -o format=raw serves the
container file's bytes as they are; a qcow2 overlay over such a backing file
is refused unless it records backing_fmt=raw; qcowfs info/check/map refuse
them the same way and take -f raw."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20

# name: (qemu-img create arguments before the file name, file to mount, words the message must hold)
FORMATS = {
    "qcow": (["-f", "qcow"], "disk.qcow", "qcow (version 1)"),
}


def create(workdir: Path, kind: str) -> Path:
    args, name, _ = FORMATS[kind]
    image = workdir / name
    helpers.run(["qemu-img", "create", "-q", *args, image, "16M"])
    return image


def qcowfs_tool(*args) -> subprocess.CompletedProcess:
    return helpers.run([helpers.qcowfs_bin(), *args], check=False)


@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("rw", [False, True], ids=["ro", "rw"])
def test_mount_is_refused_naming_the_format(workdir: Path, kind: str, rw: bool) -> None:
    image = create(workdir, kind)
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view", ["rw"] if rw else [])
    assert code != 0
    assert f"is a {FORMATS[kind][2]}" in text, text
    assert "format=raw" in text, text
    assert helpers.sha256_file(image) == before


def test_naming_a_foreign_format_is_refused_naming_it(workdir: Path) -> None:
    """-o format=qcow is a known format qcowfs does not read: the mount says so."""
    image = create(workdir, "qcow")
    code, text = helpers.mount_fails(image, workdir / "view", ["format=qcow"])
    assert code != 0
    assert "qcow (version 1)" in text and "format=raw" in text, text


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_format_raw_serves_the_container_file(workdir: Path, kind: str) -> None:
    image = create(workdir, kind)
    before = helpers.sha256_file(image)
    with helpers.mounted(image, workdir / "view", ["format=raw"]) as m:
        assert m.path.stat().st_size == image.stat().st_size
        assert helpers.files_equal(m.path, image)
    assert helpers.sha256_file(image) == before


def overlay(workdir: Path, backing_fmt: str) -> tuple[Path, Path]:
    """disk.qcow, and ov.qcow2 over it recording backing_fmt."""
    base = create(workdir, "qcow")
    top = workdir / "ov.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base.name, "-F", backing_fmt, top, "16M"])
    return base, top


def test_overlay_over_qcow1_is_refused(workdir: Path) -> None:
    base, top = overlay(workdir, "qcow")
    hashes = (helpers.sha256_file(base), helpers.sha256_file(top))
    code, text = helpers.mount_fails(top, workdir / "view", ["rw"])
    assert "qcow (version 1)" in text and "backing_fmt=qcow" in text, text
    assert "disk.qcow" in text and "ov.qcow2" in text, text
    assert (helpers.sha256_file(base), helpers.sha256_file(top)) == hashes


def test_overlay_probing_a_qcow1_backing_file_is_refused(workdir: Path) -> None:
    """No backing format recorded: the backing file is probed, found to be qcow v1, refused."""
    base, top = overlay(workdir, "qcow")
    data = bytearray(top.read_bytes()[:4096])
    pos = data.find(bytes.fromhex("e2792aca"))  # the backing format extension
    assert pos > 0
    data[pos:pos + 4] = bytes.fromhex("0000beef")  # an unknown, ignored extension now
    with open(top, "r+b") as f:
        f.write(data)
    code, text = helpers.mount_fails(top, workdir / "view")
    assert "is a qcow (version 1) image" in text and "ov.qcow2" in text and "backing_fmt=raw" in text, text


@pytest.mark.parametrize("tool", ["info", "check", "map"])
def test_tools_refuse_and_take_format_raw(workdir: Path, tool: str) -> None:
    image = create(workdir, "qcow")
    before = helpers.sha256_file(image)
    refused = qcowfs_tool(tool, image)
    assert refused.returncode == 1
    assert b"is a qcow (version 1) image" in refused.stderr, refused.stderr
    raw = qcowfs_tool(tool, "-f", "raw", image)
    if tool == "check":
        assert raw.returncode == 63, raw.stderr  # raw has no checks
    else:
        assert raw.returncode == 0, raw.stderr
    if tool == "info":
        assert b"file format: raw" in raw.stdout
    named = qcowfs_tool(tool, "-f", "qcow", image)
    assert named.returncode == 1 and b"qcow (version 1)" in named.stderr, named.stderr
    assert helpers.sha256_file(image) == before


def test_info_backing_chain_refuses_the_qcow1_layer(workdir: Path) -> None:
    _, top = overlay(workdir, "qcow")
    plain = qcowfs_tool("info", top)
    assert plain.returncode == 0 and b"backing file format: qcow" in plain.stdout
    chain = qcowfs_tool("info", "--backing-chain", top)
    assert chain.returncode == 1 and b"backing_fmt=qcow" in chain.stderr, chain.stderr
