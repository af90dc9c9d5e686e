"""QED images made by qemu-img/qemu-io, read through a read-only mount and
checked against QEMU (format_helpers.check_image: bytes, SEEK_DATA/HOLE, info
and map), for every geometry qemu-img makes, backing files (qcow2 probed, raw
recorded with the no-probe feature), zero clusters and the need-check bit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers

KiB, MiB = 1 << 10, 1 << 20
SIZE = 32 * MiB


def qed(workdir: Path, name: str, opts: str = "", cluster: int = 64 * KiB, size: int = SIZE) -> Path:
    return fh.make_image(workdir, "qed", name, size, opts, fh.scattered_writes(size, cluster))


@pytest.mark.parametrize("opts,cluster", [
    ("", 64 * KiB),
    ("cluster_size=4096", 4 * KiB),
    ("cluster_size=1M", MiB),
    ("table_size=16", 64 * KiB),
    ("cluster_size=4096,table_size=2", 4 * KiB),
], ids=["default", "cluster_4k", "cluster_1m", "table_16", "cluster_4k_table_2"])
def test_geometries_read_as_qemu_reads_them(workdir: Path, opts: str, cluster: int) -> None:
    image = qed(workdir, "disk.qed", opts, cluster)
    fh.check_image(image, workdir, fmt="qed")


def test_unaligned_size_and_direct_io(workdir: Path) -> None:
    """A size that is not a cluster multiple, read with cache=none on 4K sectors."""
    size = 20 * MiB + 3 * 512
    image = fh.make_image(workdir, "qed", "odd.qed", size, "", fh.scattered_writes(size, 64 * KiB, seed=3))
    fh.check_image(image, workdir, fmt="qed")
    fh.check_image_direct(image, workdir, fmt="qed")


def test_zero_clusters(workdir: Path) -> None:
    """write -z of whole clusters leaves zero clusters (L2 entry 1), over data and holes."""
    image = fh.make_image(workdir, "qed", "zero.qed", SIZE, "", [
        "write -P 0x31 0 1M", "write -z 128k 192k", "write -z 4M 128k", "write -P 0x32 5M 64k"])
    entries = helpers.qemu_img_map(image, fmt="qed")
    assert any(e["present"] and e["zero"] and not e["data"] for e in entries), entries
    fh.check_image(image, workdir, fmt="qed")


def test_table_size_1_is_refused_like_qemu(workdir: Path) -> None:
    """qemu-img creates table_size=1 images that QEMU itself cannot open: the
    table offset check's overflow test (end <= start) fails for one-cluster tables."""
    image = workdir / "t1.qed"
    helpers.run(["qemu-img", "create", "-q", "-f", "qed", "-o", "cluster_size=4096,table_size=1", image, "8M"])
    qemu = helpers.run(["qemu-io", "-r", "-f", "qed", "-c", "read 0 512", image], check=False)
    assert b"QED table offset is invalid" in qemu.stderr + qemu.stdout
    _, text = helpers.mount_fails(image, workdir / "view")
    assert "QED table offset is invalid" in text, text


@pytest.mark.parametrize("base_fmt", ["qcow2", "raw"])
def test_backing_file(workdir: Path, base_fmt: str) -> None:
    """A QED overlay over a qcow2 base (format probed) or a raw one (the
    no-probe feature: "backing-filename-format": "raw"), shorter than the overlay."""
    base = fh.make_image(workdir, base_fmt, f"base.{base_fmt}", 24 * MiB, "",
                         ["write -P 0x51 0 24M", "write -z 2M 1M"])
    top = workdir / "top.qed"
    helpers.run(["qemu-img", "create", "-q", "-f", "qed", "-b", base.name, "-F", base_fmt, top, str(SIZE)])
    helpers.qemu_io(top, "write -P 0x61 1M 64k", "write -z 3M 128k", "write -P 0x62 20M 5M", fmt="qed")
    info = helpers.qemu_img_info(top, fmt="qed")
    assert info.get("backing-filename-format") == ("raw" if base_fmt == "raw" else None), info
    fh.check_image(top, workdir, fmt="qed")


def test_cross_format_chain_qed_over_qcow2(workdir: Path) -> None:
    """qcow2 base with data, zeros and compressed clusters; QED overlay over it."""
    base = fh.make_image(workdir, "qcow2", "base.qcow2", SIZE, "",
                         ["write -P 0x71 0 4M", "write -c -P 0x72 8M 64k", "write -z 1M 64k"])
    top = workdir / "top.qed"
    helpers.run(["qemu-img", "create", "-q", "-f", "qed", "-b", base.name, "-F", "qcow2", top])
    helpers.qemu_io(top, "write -P 0x73 512k 1M", "write -z 2M 64k", fmt="qed")
    reference = helpers.convert_to_raw(top, workdir / "top.ref.raw", fmt="qed")
    with helpers.mounted(top, workdir / "view") as m:
        assert helpers.files_equal(m.path, reference)
    fh.assert_map_matches(top, "qed")
    fh.assert_info_matches(top, "qed")


def test_need_check_bit_reads_and_info_matches_qemu(workdir: Path) -> None:
    """QEMU opens a QED image whose need-check bit is set read-only without a
    check, and its info shows "dirty-flag": false (the need-check timer, fired
    by the drain at the end of the open, clears the bit in memory); the file
    keeps the bit."""
    image = qed(workdir, "dirty.qed")
    with open(image, "r+b") as f:
        f.seek(16)
        features = int.from_bytes(f.read(8), "little") | 0x02
        f.seek(16)
        f.write(features.to_bytes(8, "little"))
    assert helpers.qemu_img_info(image, fmt="qed")["dirty-flag"] is False
    before = helpers.sha256_file(image)
    fh.check_image(image, workdir, fmt="qed")
    assert helpers.sha256_file(image) == before
    with open(image, "rb") as f:
        f.seek(16)
        assert int.from_bytes(f.read(8), "little") & 0x02
