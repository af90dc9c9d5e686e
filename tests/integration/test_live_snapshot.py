"""Live snapshots: `qcowfs snapshot` on an image a qcowfs mount holds (issue 34).

The client finds the daemon through the image's control socket
(/run/qcowfs/<dev>-<ino>.sock for root) and the daemon takes the snapshot
without unmounting. QEMU is the referee: after unmount `qemu-img snapshot -l`
lists what was made, `qemu-img check` is clean and `qemu-img convert -l`
reads the snapshot.

"As the disk was at the snapshot" is checkable because a writer stamps every
4 KiB block it writes with a sequence number (and the block's index, 256
times over), round robin over the disk, while `snapshot -c` runs. The
snapshot must then hold a prefix of the writes: with P its highest stamp,
every block holds the last write to it numbered <= P (nothing older, nothing
newer, nothing torn), and P lies between the last write acknowledged before
the command started and the last acknowledged when it returned (+1: the
writer notes an acknowledgement just after the write returns).

`--external` is checked the same way on the old top, read by qemu-img (check,
convert, compare) while the mount goes on writing into the new overlay.

Images are 4 MiB; the whole file takes a few seconds.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

from qcowfs_testlib import helpers

BLOCK = 4096
SIZE = 4 << 20
BLOCKS = SIZE // BLOCK


def control_socket(image: Path) -> Path:
    st = os.stat(image)
    return Path("/run/qcowfs") / f"{st.st_dev:x}-{st.st_ino:x}.sock"


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on (what a killed daemon leaves)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    assert path.exists()


def qcowfs_snapshot(*args, user: bool = False) -> subprocess.CompletedProcess:
    argv = [helpers.qcowfs_bin(), "snapshot", *map(str, args)]
    if user:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    return helpers.run(argv, check=False)


def stamp(seq: int, block: int) -> bytes:
    return struct.pack("<QQ", seq, block) * (BLOCK // 16)


class Writer(threading.Thread):
    """Writes stamp(seq, seq % BLOCKS) at block seq % BLOCKS, seq = 1, 2, ..."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path = path
        self.acked = 0  # the last seq whose pwrite returned
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
            try:
                seq = 0
                while not self.stop.is_set():
                    seq += 1
                    block = seq % BLOCKS
                    assert os.pwrite(fd, stamp(seq, block), block * BLOCK) == BLOCK
                    self.acked = seq
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while self.acked < n and self.error is None:
            assert time.monotonic() < deadline, "the writer made no progress"
            time.sleep(0.01)
        assert self.error is None, self.error


def last_write(block: int, upto: int) -> int:
    """The seq of the last write to block numbered <= upto (0: none)."""
    if upto < block and block != 0:
        return 0
    seq = upto - ((upto - block) % BLOCKS)
    return seq if seq > 0 else 0


def stamps(raw: Path) -> list[int]:
    """Each block's seq; fails on a block that is not one whole stamp."""
    out = []
    data = raw.read_bytes()
    assert len(data) == SIZE
    for b in range(BLOCKS):
        chunk = data[b * BLOCK:(b + 1) * BLOCK]
        if chunk == bytes(BLOCK):
            out.append(0)
            continue
        seq, block = struct.unpack_from("<QQ", chunk)
        assert block == b and chunk == stamp(seq, b), f"block {b} is torn or misplaced"
        out.append(seq)
    return out


def assert_prefix(seqs: list[int], low: int, high: int) -> None:
    """seqs is the disk after writes 1..P exactly, for some low <= P <= high."""
    p = max(seqs)
    assert low <= p <= high, f"snapshot at write {p}, not within [{low}, {high}]"
    wrong = [b for b in range(BLOCKS) if seqs[b] != last_write(b, p)]
    assert not wrong, f"blocks {wrong[:8]} do not hold the last write <= {p}"


def test_live_internal_snapshot_while_writing(workdir):
    image = workdir / "disk.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)])
    sock = control_socket(image)
    stale_socket(sock)  # a killed daemon's leftover: the mount must replace it
    # Others may reach the image (so a non-owner is refused by the mount's
    # control socket and lock, not by the file's mode).
    os.chmod(workdir, 0o755)
    os.chmod(image, 0o666)
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        writer = Writer(m.path)
        writer.start()
        try:
            writer.wait_for(2 * BLOCKS)  # every block written, some twice
            low = writer.acked
            r = qcowfs_snapshot("-c", "s1", image)
            high = writer.acked + 1
            assert r.returncode == 0, r.stderr.decode()
            writer.wait_for(high + BLOCKS)  # it goes on writing after the snapshot
        finally:
            writer.stop.set()
            writer.join()
        assert writer.error is None, writer.error
        final = writer.acked

        listing = qcowfs_snapshot("-l", image)
        assert listing.returncode == 0 and " s1 " in listing.stdout.decode(), listing.stderr.decode()
        r = qcowfs_snapshot("-a", "s1", image)
        assert r.returncode == 1 and "unmount it first" in r.stderr.decode(), r.stderr.decode()
        r = qcowfs_snapshot("-c", "x", image, user=True)
        assert r.returncode == 1 and "only the mount's owner and root" in r.stderr.decode(), r.stderr.decode()
        assert qcowfs_snapshot("-c", "s2", image).returncode == 0
        r = qcowfs_snapshot("-d", "s2", image)
        assert r.returncode == 0, r.stderr.decode()
        assert sock.is_socket()
    assert not sock.exists(), "the daemon left its control socket behind"

    qemu_list = helpers.run(["qemu-img", "snapshot", "-l", image]).stdout.decode()
    assert [line.split()[1] for line in qemu_list.splitlines()[2:]] == ["s1"], qemu_list
    helpers.qemu_img_check(image)
    snap = workdir / "s1.raw"
    helpers.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", "-l", "snapshot.name=s1", image, snap])
    assert_prefix(stamps(snap), low, high)
    active = helpers.convert_to_raw(image, workdir / "active.raw")
    assert stamps(Path(active)) == [last_write(b, final) for b in range(BLOCKS)]

    # Offline again: a stale socket is skipped (and removed), the image opened.
    stale_socket(sock)
    r = qcowfs_snapshot("-c", "s3", image)
    assert r.returncode == 0, r.stderr.decode()
    assert not sock.exists()
    helpers.qemu_img_check(image)

    # A read-only mount showing s1: deleting s1 is refused by the mount.
    with helpers.mounted(image, workdir / "view", ["snapshot=s1"]):
        r = qcowfs_snapshot("-d", "s1", image)
        assert r.returncode == 1 and "showing this snapshot" in r.stderr.decode(), r.stderr.decode()
    assert "s1" in helpers.run(["qemu-img", "snapshot", "-l", image]).stdout.decode()


def test_live_external_snapshot_while_writing(workdir):
    image = workdir / "top.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)])
    overlay = workdir / "new.qcow2"
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        writer = Writer(m.path)
        writer.start()
        try:
            writer.wait_for(2 * BLOCKS)
            low = writer.acked
            r = qcowfs_snapshot("--external", overlay, image)
            high = writer.acked + 1
            assert r.returncode == 0, r.stderr.decode()
            writer.wait_for(high + BLOCKS)
            # The mount writes on into the overlay; the old top is a stable
            # image QEMU reads with its own (shared) locks meanwhile.
            helpers.qemu_img_check(image)
            old = helpers.convert_to_raw(image, workdir / "old.raw", fmt="qcow2")
            r = helpers.run(["qemu-img", "compare", "-f", "qcow2", "-F", "raw", image, old], check=False)
            assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
            writer.wait_for(writer.acked + BLOCKS)
        finally:
            writer.stop.set()
            writer.join()
        assert writer.error is None, writer.error
        final = writer.acked
        assert control_socket(overlay).is_socket() and not control_socket(image).exists()
    assert_prefix(stamps(old), low, high)
    info = helpers.qemu_img_info(overlay)
    assert info["backing-filename"] == str(image) and info["backing-filename-format"] == "qcow2", info
    helpers.qemu_img_check(overlay)
    helpers.qemu_img_check(image)
    active = helpers.convert_to_raw(overlay, workdir / "active.raw")
    assert stamps(active) == [last_write(b, final) for b in range(BLOCKS)]
