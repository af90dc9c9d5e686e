"""Parallels images read through a read-only mount, refereed by QEMU
(format_helpers.check_image): the default 1 MiB clusters, 64 KiB and 4 MiB
clusters, sizes that are not a multiple of the cluster, scattered data, the old
"WithoutFreeSpace" magic (BAT entries in sectors), an image left "in use"
(QEMU opens it read-only as it is). Writing: tests/integration/test_rw_formats.py."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from qcowfs_testlib import helpers
from qcowfs_testlib.format_helpers import KiB, MiB, check_image, check_image_direct, make_image, scattered_writes

VARIANTS = {
    # name: (create options, size, cluster size)
    "default_16m": ("", 16 * MiB, MiB),
    "cluster_64k": ("cluster_size=64k", 8 * MiB, 64 * KiB),
    "cluster_4m": ("cluster_size=4M", 32 * MiB, 4 * MiB),
    "size_not_cluster_multiple": ("", 16 * MiB + 3 * 512, MiB),
    "cluster_4m_odd_size": ("cluster_size=4M", 10 * MiB + 512, 4 * MiB),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_reads_as_qemu_reads_it(workdir: Path, name: str) -> None:
    opts, size, cluster = VARIANTS[name]
    image = make_image(workdir, "parallels", f"{name}.hds", size, opts, scattered_writes(size, cluster))
    check_image(image, workdir, fmt="parallels")


def test_fresh_image_probed(workdir: Path) -> None:
    image = make_image(workdir, "parallels", "fresh.hds", 8 * MiB)
    check_image(image, workdir, fmt="parallels")
    reference = helpers.convert_to_raw(image, workdir / "fresh.ref.raw", fmt="parallels")
    with helpers.mounted(image, workdir / "probed.raw") as m:  # no format=: probed by its magic
        assert helpers.files_equal(m.path, reference)


def test_scattered_direct(workdir: Path) -> None:
    image = make_image(workdir, "parallels", "direct.hds", 16 * MiB, "cluster_size=64k",
                       scattered_writes(16 * MiB, 64 * KiB, seed=5))
    check_image_direct(image, workdir, fmt="parallels")


def patch(image: Path, off: int, fmt: str, value) -> None:
    with open(image, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))


def test_old_magic_bat_in_sectors(workdir: Path) -> None:
    """"WithoutFreeSpace": BAT entries count sectors, not clusters."""
    image = make_image(workdir, "parallels", "old.hds", 8 * MiB, "cluster_size=64k",
                       ["write -P 0x61 0 64k", "write -P 0x62 1M 128k", "write -P 0x63 7M 4k"])
    data = bytearray(image.read_bytes())
    tracks, entries = struct.unpack_from("<II", data, 28)
    data[0:16] = b"WithoutFreeSpace"
    for i in range(entries):
        (e,) = struct.unpack_from("<I", data, 64 + 4 * i)
        struct.pack_into("<I", data, 64 + 4 * i, e * tracks)
    image.write_bytes(data)
    check_image(image, workdir, fmt="parallels")


def test_image_left_in_use_reads(workdir: Path) -> None:
    image = make_image(workdir, "parallels", "inuse.hds", 8 * MiB, cmds=["write -P 0x71 2M 1M"])
    patch(image, 44, "<I", 0x746F6E59)
    check_image(image, workdir, fmt="parallels")


def add_extension(image: Path, corrupt: bool = False) -> None:
    """Appends a format extension cluster (no features, its MD5 recorded) and
    points ext_off at it; corrupt flips a checksum bit."""
    import hashlib
    data = bytearray(image.read_bytes())
    (tracks,) = struct.unpack_from("<I", data, 28)
    cluster = tracks * 512
    at = (len(data) + cluster - 1) // cluster * cluster
    data += bytes(at - len(data))
    body = bytes(cluster - 24)
    digest = bytearray(hashlib.md5(body).digest())
    if corrupt:
        digest[0] ^= 1
    data += struct.pack("<Q", 0xAB234CEF23DCEA87) + digest + body
    struct.pack_into("<Q", data, 56, at // 512)
    image.write_bytes(data)


def test_format_extension_with_its_checksum_reads(workdir: Path) -> None:
    image = make_image(workdir, "parallels", "ext.hds", 4 * MiB, "cluster_size=64k", ["write -P 0x51 0 64k"])
    add_extension(image)
    check_image(image, workdir, fmt="parallels")


def test_format_extension_with_a_bad_checksum_is_refused_like_qemu(workdir: Path) -> None:
    image = make_image(workdir, "parallels", "extbad.hds", 4 * MiB, "cluster_size=64k")
    add_extension(image, corrupt=True)
    assert helpers.run(["qemu-img", "info", str(image)], check=False).returncode != 0
    code, text = helpers.mount_fails(image, workdir / "view")
    assert code != 0 and "checksum" in text, text
