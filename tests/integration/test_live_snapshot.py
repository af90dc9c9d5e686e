"""Live snapshots: `qcowfs snapshot` on an image a qcowfs mount holds (issue 34).

The client finds the daemon through the image's control socket
(/run/qcowfs/<dev>-<ino>.sock for root) and the daemon takes the snapshot
without unmounting. QEMU is the referee: after unmount `qemu-img snapshot -l`
lists what was made, `qemu-img check` is clean and `qemu-img convert -l`
reads the snapshot.

"As the disk was at the snapshot" is checkable because a writer stamps every
4 KiB block it writes with a sequence number (and the block's index, 256
times over), round robin over its own quarter of the disk, four writers at
once (so up to four writes are in flight when the mount quiesces), while
`snapshot -c` runs. The snapshot must then hold a prefix of each writer's
writes: with P its highest stamp there, each of its blocks holds its last
write to it numbered <= P (nothing older, nothing newer, nothing torn), and P
lies between its last write acknowledged before the command started and its
last acknowledged when it returned (+1: a writer notes an acknowledgement just
after the write returns).

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


WRITERS = 4  # threads, each with its own blocks and numbering: up to 4 writes in flight
SPAN = BLOCKS // WRITERS  # blocks per writer: writer k owns blocks k, k + WRITERS, ...


class Writer(threading.Thread):
    """Writer k: its write seq (1, 2, ...) goes to its block (seq % SPAN)."""

    def __init__(self, path: Path, k: int):
        super().__init__(daemon=True)
        self.path = path
        self.k = k
        self.acked = 0  # the last seq whose pwrite returned
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def block(self, seq: int) -> int:
        return self.k + WRITERS * (seq % SPAN)

    def run(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
            try:
                seq = 0
                while not self.stop.is_set():
                    seq += 1
                    b = self.block(seq)
                    assert os.pwrite(fd, stamp(seq, b), b * BLOCK) == BLOCK
                    self.acked = seq
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


class Writers:
    def __init__(self, path: Path):
        self.threads = [Writer(path, k) for k in range(WRITERS)]

    def __enter__(self) -> "Writers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            t.stop.set()
        for t in self.threads:
            t.join()
        self.check()

    def check(self) -> None:
        for t in self.threads:
            assert t.error is None, t.error

    def acked(self) -> list[int]:
        return [t.acked for t in self.threads]

    def wait_for(self, counts: list[int]) -> None:
        deadline = time.monotonic() + 30
        while any(t.acked < n for t, n in zip(self.threads, counts)):
            self.check()
            assert time.monotonic() < deadline, "the writers made no progress"
            time.sleep(0.01)
        self.check()


def last_write(j: int, upto: int) -> int:
    """The seq of a writer's last write numbered <= upto to its j-th block (0: none)."""
    seq = upto - ((upto - j) % SPAN)
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


def writer_blocks(seqs: list[int], k: int) -> list[int]:
    """Writer k's blocks, j = 0 .. SPAN-1."""
    return [seqs[k + WRITERS * j] for j in range(SPAN)]


def assert_prefix(seqs: list[int], low: list[int], high: list[int]) -> None:
    """Each writer's blocks are the disk after its writes 1..P exactly, for
    some low <= P <= high (its acknowledged writes at the two moments)."""
    for k in range(WRITERS):
        mine = writer_blocks(seqs, k)
        p = max(mine)
        assert low[k] <= p <= high[k], f"writer {k}: snapshot at write {p}, not within [{low[k]}, {high[k]}]"
        wrong = [j for j in range(SPAN) if mine[j] != last_write(j, p)]
        assert not wrong, f"writer {k}: blocks {wrong[:8]} do not hold the last write <= {p}"


def assert_final(seqs: list[int], final: list[int]) -> None:
    for k in range(WRITERS):
        assert writer_blocks(seqs, k) == [last_write(j, final[k]) for j in range(SPAN)], f"writer {k}"


def assert_daemon_refuses_other_user(image: Path, sock: Path) -> None:
    """With the directory and socket opened up, the daemon's SO_PEERCRED check
    still refuses a user other than the mount's owner."""
    os.chmod(sock.parent, 0o711)
    os.chmod(sock, 0o666)
    try:
        r = qcowfs_snapshot("-c", "x", image, user=True)
    finally:
        os.chmod(sock, 0o600)
        os.chmod(sock.parent, 0o700)
    assert r.returncode == 1 and "only that user and root may use" in r.stderr.decode(), r.stderr.decode()


def assert_qemu_sees_s1_as_it_was(image: Path, workdir: Path, names: list[str], low: list[int],
                                  high: list[int], final: list[int]) -> None:
    """After unmount: qemu-img lists exactly NAMES, check is clean, snapshot s1
    holds every write acknowledged before it (and none begun after), and the
    active layer every write acknowledged at the end."""
    qemu_list = helpers.run(["qemu-img", "snapshot", "-l", image]).stdout.decode()
    assert [line.split()[1] for line in qemu_list.splitlines()[2:]] == names, qemu_list
    helpers.qemu_img_check(image)
    snap = workdir / "s1.raw"
    helpers.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", "-l", "snapshot.name=s1", image, snap])
    assert_prefix(stamps(snap), low, high)
    assert_final(stamps(helpers.convert_to_raw(image, workdir / "active.raw")), final)


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
        with Writers(m.path) as w:
            # Half of the disk written: the writes the snapshot meets allocate
            # clusters (a write that is not drained loses its L2 entry).
            w.wait_for([SPAN // 2] * WRITERS)
            low = w.acked()
            r = qcowfs_snapshot("-c", "s1", image)
            high = [n + 1 for n in w.acked()]
            assert r.returncode == 0, r.stderr.decode()
            w.wait_for([n + SPAN for n in high])  # they go on writing after the snapshot
        final = w.acked()

        listing = qcowfs_snapshot("-l", image)
        assert listing.returncode == 0 and " s1 " in listing.stdout.decode(), listing.stderr.decode()
        r = qcowfs_snapshot("-a", "s1", image)
        assert r.returncode == 1 and "unmount it first" in r.stderr.decode(), r.stderr.decode()
        r = qcowfs_snapshot("-c", "x", image, user=True)
        assert r.returncode == 1 and "only the mount's owner and root" in r.stderr.decode(), r.stderr.decode()
        assert_daemon_refuses_other_user(image, sock)
        assert qcowfs_snapshot("-c", "s2", image).returncode == 0
        r = qcowfs_snapshot("-d", "s2", image)
        assert r.returncode == 0, r.stderr.decode()
        assert sock.is_socket()
    assert not sock.exists(), "the daemon left its control socket behind"

    assert_qemu_sees_s1_as_it_was(image, workdir, ["s1"], low, high, final)

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
        with Writers(m.path) as w:
            w.wait_for([SPAN // 2] * WRITERS)
            low = w.acked()
            r = qcowfs_snapshot("--external", overlay, image)
            high = [n + 1 for n in w.acked()]
            assert r.returncode == 0, r.stderr.decode()
            w.wait_for([n + SPAN for n in high])
            # The mount writes on into the overlay; the old top is a stable
            # image QEMU reads with its own (shared) locks meanwhile.
            helpers.qemu_img_check(image)
            old = helpers.convert_to_raw(image, workdir / "old.raw", fmt="qcow2")
            r = helpers.run(["qemu-img", "compare", "-f", "qcow2", "-F", "raw", image, old], check=False)
            assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
            w.wait_for([n + SPAN for n in w.acked()])
        final = w.acked()
        assert control_socket(overlay).is_socket() and not control_socket(image).exists()
    assert_prefix(stamps(old), low, high)
    info = helpers.qemu_img_info(overlay)
    assert info["backing-filename"] == str(image) and info["backing-filename-format"] == "qcow2", info
    helpers.qemu_img_check(overlay)
    helpers.qemu_img_check(image)
    assert_final(stamps(helpers.convert_to_raw(overlay, workdir / "active.raw")), final)


def test_live_snapshots_of_a_read_only_mount_show_in_its_snapshots_dir(workdir):
    """A read-only directory-mode mount: -c and -d work (the daemon opens the
    image read-write for the operation alone, or fails cleanly when another
    process holds it), snapshots/ follows them, and a snapshot whose view is
    held open is not deleted (as a QEMU reader's lock refuses qemu-img)."""
    image = workdir / "ro.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)])
    helpers.qemu_io(image, "write -q -P 0x5a 64k 1M", fmt="qcow2")
    mnt = workdir / "dir"
    mnt.mkdir()
    snaps = mnt / "snapshots"
    with helpers.mounted(image, mnt) as m:
        assert os.listdir(snaps) == []  # a live qcow2 mount has snapshots/ before its first snapshot
        r = qcowfs_snapshot("-c", "s1", image)
        assert r.returncode == 0, r.stderr.decode()
        assert os.listdir(snaps) == ["s1.raw"]
        assert helpers.files_equal(snaps / "s1.raw", m.path)  # read-only: the disk as it is
        # Another reader's lock refuses the writer the operation needs: a clean
        # failure, and the mount keeps its own lock (a writer is still refused).
        reader = subprocess.Popen(["qemu-io", "-r", "-f", "qcow2", "-c", "sleep 20000", str(image)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            time.sleep(0.5)  # qemu-io opened the image (it only sleeps after)
            r = qcowfs_snapshot("-c", "s2", image)
        finally:
            reader.kill()
            reader.wait()
        assert r.returncode == 1 and 'failed to get "write" lock' in r.stderr.decode(), r.stderr.decode()
        assert "mounted read-only" in r.stderr.decode(), r.stderr.decode()
        w = helpers.run(["qemu-io", "-f", "qcow2", "-c", "write 0 512", image], check=False)
        assert w.returncode != 0 and b'"write" lock' in w.stdout + w.stderr, w
        # A held view refuses the delete; released, it goes, and so does its entry.
        with open(snaps / "s1.raw", "rb") as held:
            r = qcowfs_snapshot("-d", "s1", image)
            assert r.returncode == 1 and "open under" in r.stderr.decode(), r.stderr.decode()
            assert held.read(4096) == bytes(4096)
        assert qcowfs_snapshot("-c", "s3", image).returncode == 0
        r = qcowfs_snapshot("-d", "s1", image)
        assert r.returncode == 0, r.stderr.decode()
        assert os.listdir(snaps) == ["s3.raw"]
        assert not (snaps / "s1.raw").exists()
        assert helpers.files_equal(m.path, snaps / "s3.raw")
    qemu_list = helpers.run(["qemu-img", "snapshot", "-l", image]).stdout.decode()
    assert [line.split()[1] for line in qemu_list.splitlines()[2:]] == ["s3"], qemu_list
    helpers.qemu_img_check(image)


def test_a_throwaway_mount_names_why_it_takes_no_snapshot(workdir):
    """-o throwaway: the mount's writes never reach IMAGE, so `snapshot -c`
    and `-d` are refused with that reason (not a bare lock error); -l lists."""
    image = workdir / "gold.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)])
    helpers.run(["qemu-img", "snapshot", "-c", "base", image])
    with helpers.mounted(image, workdir / "view", ["throwaway"]):
        for args in (["-c", "s1"], ["-d", "base"]):
            r = qcowfs_snapshot(*args, image)
            err = r.stderr.decode()
            assert r.returncode == 1 and "throwaway writes" in err and "never reach the image" in err, err
        listing = qcowfs_snapshot("-l", image)
        assert listing.returncode == 0 and " base " in listing.stdout.decode(), listing.stderr.decode()
    qemu_list = helpers.run(["qemu-img", "snapshot", "-l", image]).stdout.decode()
    assert [line.split()[1] for line in qemu_list.splitlines()[2:]] == ["base"], qemu_list


def test_live_snapshots_of_a_catalogue_image(workdir):
    """A catalogue mount (`qcowfs SRCDIR MOUNTDIR`) serves live snapshots of an
    image while it holds it open: the socket comes with the lazy open and goes
    with the idle close, after which the offline command works on the file.
    The first live -c makes <name>.d/snapshots/ appear."""
    src = workdir / "src"
    src.mkdir()
    image = src / "d.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)])
    sock = control_socket(image)
    os.chmod(workdir, 0o755)
    os.chmod(src, 0o755)
    os.chmod(image, 0o666)
    mnt = workdir / "cat"
    mnt.mkdir()
    snaps = mnt / "d.d" / "snapshots"
    with helpers.mounted(src, mnt, ["rw", "idle-timeout=0.3"]):
        assert not sock.exists()  # nothing opened yet
        assert not snaps.exists()  # no snapshot yet
        with Writers(mnt / "d.raw") as w:
            w.wait_for([SPAN // 2] * WRITERS)
            assert sock.is_socket()
            low = w.acked()
            r = qcowfs_snapshot("-c", "s1", image)
            high = [n + 1 for n in w.acked()]
            assert r.returncode == 0, r.stderr.decode()
            w.wait_for([n + SPAN for n in high])
        final = w.acked()
        with open(mnt / "d.raw", "rb"):  # holds the image open (the idle close waits)
            assert os.listdir(snaps) == ["s1.raw"]
            listing = qcowfs_snapshot("-l", image)
            assert listing.returncode == 0 and " s1 " in listing.stdout.decode(), listing.stderr.decode()
            r = qcowfs_snapshot("-a", "s1", image)
            assert r.returncode == 1 and "unmount it first" in r.stderr.decode(), r.stderr.decode()
            r = qcowfs_snapshot("--external", workdir / "new.qcow2", image)
            assert r.returncode == 1 and "catalogue view" in r.stderr.decode(), r.stderr.decode()
            assert_daemon_refuses_other_user(image, sock)
            with open(snaps / "s1.raw", "rb"):
                r = qcowfs_snapshot("-d", "s1", image)
                assert r.returncode == 1 and "open under" in r.stderr.decode() and "d.d/snapshots" in r.stderr.decode(), \
                    r.stderr.decode()
            assert qcowfs_snapshot("-c", "s2", image).returncode == 0
            assert sorted(os.listdir(snaps)) == ["s1.raw", "s2.raw"]
            with open(snaps / "s2.raw", "rb") as f:  # opened, then unused: the delete closes it first
                assert len(f.read(BLOCK)) == BLOCK
            r = qcowfs_snapshot("-d", "s2", image)
            assert r.returncode == 0, r.stderr.decode()
            assert os.listdir(snaps) == ["s1.raw"]
        # The idle close removes the socket; the offline command then works.
        deadline = time.monotonic() + 10  # generous: the delay is 0.3 s, the machine is loaded
        while sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sock.exists(), "the idle close left the control socket"
        r = qcowfs_snapshot("-c", "s3", image)
        assert r.returncode == 0, r.stderr.decode()
        assert sorted(os.listdir(snaps)) == ["s1.raw", "s3.raw"]
    assert not sock.exists()
    assert_qemu_sees_s1_as_it_was(image, workdir, ["s1", "s3"], low, high, final)
