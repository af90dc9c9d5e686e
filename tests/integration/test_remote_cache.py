"""Copy-on-read over a remote base and the disk cache of remote images (issue 33).

An nginx of test_remote.py's kind serves the images on loopback, started and
stopped by the module fixture; stopping it is how "the server is down" is
made. QEMU is the referee: `qemu-img map`/`check`/`compare` of the overlay and
`qemu-img convert` of the base.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers
from test_remote import Nginx, make_tls, mount_url, qcowfs_tool, read_at

KiB = 1024
MiB = 1024 * KiB
CLUSTER = 64 * KiB


@pytest.fixture(scope="module")
def server():
    root = Path(tempfile.mkdtemp(prefix="qcowfs-rcache-", dir=os.environ.get("QCOWFS_TEST_TMP", "/var/tmp")))
    (root / "www").mkdir()
    nginx = Nginx(root)
    try:
        make_tls(root)
        nginx.start()
        yield nginx
    finally:
        nginx.stop()
        helpers.cleanup_mounts_under(root)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def server_down(server):
    server.stop()
    try:
        yield
    finally:
        server.start()


def write_at(path: Path, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, off) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def assert_eio(path: Path, off: int, n: int) -> None:
    with pytest.raises(OSError) as e:
        read_at(path, off, n)
    assert e.value.errno == errno.EIO


def depth_at(entries: list[dict], off: int) -> int:
    """The chain depth `qemu-img map` gives the byte at off."""
    for e in entries:
        if e["start"] <= off < e["start"] + e["length"]:
            return e["depth"]
    raise AssertionError(f"{off} not in the map")


def test_copy_on_read_fills_the_overlay_for_a_mount_without_the_server(server, workdir):
    data = bytearray(os.urandom(4 * MiB))
    data[3 * MiB:3 * MiB + 256 * KiB] = bytes(256 * KiB)  # zeros: copied as zero clusters
    (workdir / "base.raw").write_bytes(data)
    helpers.qemu_img("convert", "-f", "raw", "-O", "qcow2", workdir / "base.raw", server.root / "www" / "cor.qcow2")
    base = server.url("cor.qcow2")
    overlay = workdir / "overlay.qcow2"
    qcowfs_tool("create", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay)
    # Reads far from the unread clusters (the view is direct_io: the kernel reads no more than asked).
    reads = [(100, 70000), (MiB + 4096, 8192), (2 * MiB - 100, 200), (3 * MiB + 1000, 4096)]
    unread = [5 * MiB // 4, 7 * MiB // 2]
    written_at, written = 2 * MiB + 512 * KiB, os.urandom(CLUSTER + 512)
    opts = ["rw", "copy-on-read", "remote-timeout=5"]
    with mount_url(str(overlay), workdir / "view", opts) as view:
        write_at(view, written_at, written)  # a guest write: copy-on-read leaves it alone
        for off, n in reads:
            assert read_at(view, off, n) == data[off:off + n]
        assert read_at(view, written_at - 100, 200) == bytes(data[written_at - 100:written_at]) + written[:100]
    expected = bytearray(data)
    expected[written_at:written_at + len(written)] = written
    (workdir / "expected.raw").write_bytes(expected)

    # QEMU (its curl driver reads the base): a clean image, the bytes expected,
    # and every cluster a read touched now in the overlay, whole.
    helpers.qemu_img_check(overlay)
    assert "Images are identical" in helpers.qemu_img("compare", "-f", "qcow2", "-F", "raw", overlay,
                                                      workdir / "expected.raw")
    entries = helpers.qemu_img_map(overlay, fmt="qcow2")
    for off, n in reads:
        first, last = off // CLUSTER * CLUSTER, (off + n - 1) // CLUSTER * CLUSTER
        assert depth_at(entries, first) == 0 and depth_at(entries, last + CLUSTER - 1) == 0, (off, n, entries)
    for off in unread:
        assert depth_at(entries, off) == 1, off
    _, err = helpers.mount_fails(overlay, workdir / "ro-view", ["copy-on-read"])  # read-only: refused, as QEMU
    assert "copy-on-read on read-only device" in err, err

    with server_down(server):  # remote-timeout=1: the backing file's open gives up after a second
        with mount_url(str(overlay), workdir / "view", ["rw", "copy-on-read", "remote-timeout=1"]) as view:
            for off, n in reads:
                first, end = off // CLUSTER * CLUSTER, (off + n + CLUSTER - 1) // CLUSTER * CLUSTER
                assert read_at(view, first, end - first) == data[first:end], (off, n)
            assert read_at(view, written_at, len(written)) == written
            for off in unread:
                assert_eio(view, off, 4096)
        log = (workdir / "view.log").read_text()
        assert base in log and "fail with EIO until it opens" in log, log


def test_disk_cache_serves_a_later_mount_without_the_server(server, workdir):
    www = server.root / "www"
    old = os.urandom(2 * MiB)
    (www / "cached.raw").write_bytes(old)
    url = server.url("cached.raw")
    cache = workdir / "cache"
    opts = ["format=raw", f"remote-cache-dir={cache}", "remote-block-size=64K", "remote-readahead=0",
            "remote-timeout=5"]
    offline = opts[:-1] + ["remote-timeout=1"]  # the open with the server down gives up after a second
    parts = [(0, 65536), (MiB + 100, 5000)]
    with mount_url(url, workdir / "view", opts) as view:
        for off, n in parts:
            assert read_at(view, off, n) == old[off:off + n]
        # A second mount of the same object at once does not share the entry.
        with mount_url(url, workdir / "other", opts) as other:
            assert read_at(other, 0, 4096) == old[:4096]
        assert "in use by another mount" in (workdir / "other.log").read_text()
    assert len(list(cache.iterdir())) == 1

    with server_down(server):
        with mount_url(url, workdir / "view", offline) as view:
            for off, n in parts:
                assert read_at(view, off, n) == old[off:off + n]
            assert_eio(view, MiB // 2, 4096)  # never read: not kept
        assert "serving what" in (workdir / "view.log").read_text()

    # The object replaced on the server (same size, another ETag): the entry
    # is emptied, every read has the new object's bytes.
    new = os.urandom(2 * MiB)
    replacement = workdir / "new.raw"
    replacement.write_bytes(new)
    st = os.stat(www / "cached.raw")
    os.utime(replacement, (st.st_atime + 10, st.st_mtime + 10))
    os.replace(replacement, www / "cached.raw")
    with mount_url(url, workdir / "view", opts) as view:
        for off, n in parts + [(MiB // 2, 4096)]:  # the kept blocks of parts were the old object's
            assert read_at(view, off, n) == new[off:off + n]
    assert "0 KiB kept" in (workdir / "view.log").read_text()
