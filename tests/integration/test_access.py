"""Who may use a mount: the view's owner, group and mode follow the image file.

Root mounts images of different modes with and without allow_other, and a
second local user, created for each test (qcowfs-t-XXXXXX, removed after,
pass or fail), tries to read, write and chmod the view, the partition files
and the snapshot files. Every operation of that user runs in a child process
with its ids (setpriv), which prints "ok ..." or the errno name it got.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
ATTR_TIMEOUT_S = 1.2  # the kernel keeps attributes for 1 s (kAttrTimeout)
PATTERN_AT = 1 * MiB  # the first partition starts here; the data written there
PATTERN = bytes([0x5A]) * 16
NOBODY = pwd.getpwnam("nobody")

# Run as the other user: OP PATH [HEX] -> "ok [hex of what was read]" or an errno name.
PROBE = r"""
import errno, os, sys
op, path = sys.argv[1], sys.argv[2]
try:
    if op == "read":
        fd = os.open(path, os.O_RDONLY)
        print("ok", os.pread(fd, 16, int(sys.argv[3])).hex())
    elif op == "write":
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, bytes.fromhex(sys.argv[3]), int(sys.argv[4]))
        os.fsync(fd)
        print("ok")
    elif op == "list":
        print("ok", ",".join(sorted(os.listdir(path))))
    elif op == "chmod":
        os.chmod(path, int(sys.argv[3], 8))
        print("ok")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


@dataclass
class User:
    name: str
    uid: int
    gid: int

    def run(self, *args: str) -> str:
        """Runs PROBE with args as this user (no supplementary groups); its one-line answer."""
        return run_as(self.uid, self.gid, *args)


def run_as(uid: int, gid: int, *args: str) -> str:
    proc = helpers.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                        sys.executable, "-c", PROBE, *map(str, args)])
    return proc.stdout.decode().strip()


@pytest.fixture
def user() -> User:
    name = f"qcowfs-t-{secrets.token_hex(3)}"
    helpers.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/sh", name])
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        helpers.run(["userdel", "-r", name], check=False)
        with pytest.raises(KeyError):
            pwd.getpwnam(name)


@pytest.fixture
def shared(workdir: Path) -> Path:
    """workdir, traversable by everyone (mkdtemp makes it 0700)."""
    os.chmod(workdir, 0o755)
    return workdir


def make_disk(directory: Path, mode: int, fmt: str = "qcow2") -> Path:
    """An 8 MiB disk with one partition from 1 MiB holding PATTERN at its start;
    qcow2 disks also have an internal snapshot 'snap1' of that state."""
    raw = directory / "disk-src.raw"
    with open(raw, "wb") as f:
        f.truncate(8 * MiB)
    helpers.run(["sfdisk", "-q", "--no-reread", "--no-tell-kernel", raw], input=b"label: dos\n2048,,L\n")
    helpers.qemu_io(raw, f"write -P 0x5a {PATTERN_AT} 64k", fmt="raw")
    if fmt == "raw":
        image = directory / "disk.img"
        raw.rename(image)
    else:
        image = directory / "disk.qcow2"
        helpers.qemu_img("convert", "-f", "raw", "-O", "qcow2", raw, image)
        raw.unlink()
        helpers.qemu_img("snapshot", "-c", "snap1", image)
    os.chown(image, 0, 0)
    os.chmod(image, mode)
    return image


def dir_paths(m: helpers.Mount) -> dict[str, Path]:
    """The files a directory-mode mount of make_disk's qcow2 image shows."""
    return {"view": m.path, "partition": m.target / "partitions" / "p1.raw",
            "snapshot": m.target / "snapshots" / "snap1.raw"}


def perms(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def read_ok(answer: str) -> bool:
    return answer == f"ok {PATTERN.hex()}"


def offset_of(kind: str) -> int:
    return 0 if kind == "partition" else PATTERN_AT


# --------------------------------------------------------------------------
# Private images stay private


@pytest.mark.parametrize("rw", [False, True], ids=["ro", "rw"])
def test_private_image_over_a_file(shared: Path, user: User, rw: bool) -> None:
    image = make_disk(shared, 0o600, "raw")
    with helpers.mounted(image, shared / "view.raw", ["allow_other"] + (["rw"] if rw else [])) as m:
        st = os.stat(m.path)
        assert (st.st_uid, st.st_gid) == (0, 0)
        assert stat.S_IMODE(st.st_mode) == (0o600 if rw else 0o400), oct(st.st_mode)
        assert user.run("read", m.path, PATTERN_AT) == "EACCES"
        assert user.run("write", m.path, "00", 0) in ("EACCES", "EROFS")
        assert run_as(NOBODY.pw_uid, NOBODY.pw_gid, "read", m.path, PATTERN_AT) == "EACCES"
        with open(m.path, "rb") as f:  # root still reads it
            assert os.pread(f.fileno(), 16, PATTERN_AT) == PATTERN


def test_private_image_in_a_directory(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600)
    mnt = shared / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["allow_other", "rw"]) as m:
        paths = dir_paths(m)
        assert perms(mnt) == 0o500
        assert perms(mnt / "partitions") == 0o500
        assert perms(mnt / "snapshots") == 0o500
        assert perms(paths["view"]) == 0o600
        assert perms(paths["partition"]) == 0o600
        assert perms(paths["snapshot"]) == 0o400
        for p in (mnt, mnt / "partitions", mnt / "snapshots"):
            assert user.run("list", p) == "EACCES", p
        for kind, p in paths.items():
            assert user.run("read", p, offset_of(kind)) == "EACCES", kind
            assert user.run("write", p, "00", 0) == "EACCES", kind
        with open(paths["partition"], "rb") as f:
            assert f.read(16) == PATTERN


def test_group_readable_image_lets_the_group_read(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o640)
    os.chown(image, 0, user.gid)
    mnt = shared / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["allow_other", "rw"]) as m:
        assert os.stat(m.path).st_gid == user.gid
        assert perms(m.path) == 0o640
        assert perms(mnt / "partitions") == 0o550
        for kind, p in dir_paths(m).items():
            assert read_ok(user.run("read", p, offset_of(kind))), kind
            assert user.run("write", p, "00", 0) == "EACCES", kind
        assert run_as(NOBODY.pw_uid, NOBODY.pw_gid, "read", m.path, PATTERN_AT) == "EACCES"


# --------------------------------------------------------------------------
# Readable images are readable, and never writable on read-only mounts


def test_public_image_read_only_mount(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o666)
    mnt = shared / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["allow_other"]) as m:
        paths = dir_paths(m)
        assert perms(mnt) == 0o555
        assert user.run("list", mnt) == "ok disk.raw,partitions,snapshots"
        assert user.run("list", mnt / "partitions") == "ok p1.raw"
        for kind, p in paths.items():
            assert perms(p) == 0o444, kind
            assert read_ok(user.run("read", p, offset_of(kind))), kind
            assert user.run("write", p, "00", 0) in ("EROFS", "EACCES"), kind
    helpers.qemu_io(image, f"read -P 0x5a {PATTERN_AT} 64k")


def test_public_image_over_a_file(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o644, "raw")
    with helpers.mounted(image, shared / "view.raw", ["allow_other"]) as m:
        assert perms(m.path) == 0o444
        assert read_ok(user.run("read", m.path, PATTERN_AT))
        assert user.run("write", m.path, "00", 0) in ("EROFS", "EACCES")
    with helpers.mounted(image, shared / "view.raw", ["allow_other", "rw"]) as m:
        assert perms(m.path) == 0o644
        assert read_ok(user.run("read", m.path, PATTERN_AT))
        assert user.run("write", m.path, "00", 0) == "EACCES"  # rw for root only


# --------------------------------------------------------------------------
# uid=, gid=, umask=


def test_uid_and_umask_hand_the_view_to_one_user(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600)
    mnt = shared / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["allow_other", "rw", f"uid={user.name}", "umask=077"]) as m:
        st = os.stat(m.path)
        assert st.st_uid == user.uid and stat.S_IMODE(st.st_mode) == 0o600
        assert perms(mnt) == 0o500 and os.stat(mnt).st_uid == user.uid
        assert read_ok(user.run("read", m.path, PATTERN_AT))
        assert user.run("write", m.path, "a5" * 8, 2 * MiB) == "ok"
        assert user.run("read", dir_paths(m)["snapshot"], PATTERN_AT) == f"ok {PATTERN.hex()}"
        assert user.run("write", dir_paths(m)["snapshot"], "00", 0) == "EACCES"
        # ... and nothing else: nobody else gets in, and the user cannot change that.
        assert run_as(NOBODY.pw_uid, NOBODY.pw_gid, "read", m.path, PATTERN_AT) == "EACCES"
        assert user.run("chmod", m.path, "666") == "EPERM"
        assert perms(m.path) == 0o600
    helpers.qemu_io(image, f"read -P 0xa5 {2 * MiB} 8")
    assert stat.S_IMODE(os.stat(image).st_mode) == 0o600 and os.stat(image).st_uid == 0


def test_gid_and_umask_share_with_a_group(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600, "raw")
    with helpers.mounted(image, shared / "view.raw",
                         ["allow_other", "rw", f"gid={user.gid}", "umask=007"]) as m:
        st = os.stat(m.path)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, user.gid, 0o660)
        assert user.run("write", m.path, "c3" * 4, 3 * MiB) == "ok"
        assert run_as(NOBODY.pw_uid, NOBODY.pw_gid, "read", m.path, 0) == "EACCES"
    helpers.qemu_io(image, f"read -P 0xc3 {3 * MiB} 4")


def test_umask_on_read_only_mount_grants_no_write(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600, "raw")
    with helpers.mounted(image, shared / "view.raw", ["allow_other", "umask=0"]) as m:
        assert perms(m.path) == 0o444
        assert read_ok(user.run("read", m.path, PATTERN_AT))
        assert user.run("write", m.path, "00", 0) in ("EROFS", "EACCES")


def test_another_owner_needs_allow_other(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600, "raw")
    for opt in (f"uid={user.uid}", f"gid={user.gid}", f"uid={user.name}"):
        _, text = helpers.mount_fails(image, shared / "view.raw", [opt])
        assert "allow_other" in text, text
    for opt, word in (("umask=9", "umask"), ("uid=no-such-user-qcowfs", "no-such-user-qcowfs"),
                      ("dmask=1777", "dmask")):
        _, text = helpers.mount_fails(image, shared / "view.raw", ["allow_other", opt])
        assert word in text, text


# --------------------------------------------------------------------------
# chmod / chown on the view


def test_chmod_changes_what_the_user_can_do(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600)
    mnt = shared / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["allow_other", "rw"]) as m:
        paths = dir_paths(m)
        assert user.run("read", m.path, PATTERN_AT) == "EACCES"
        os.chmod(m.path, 0o644)
        assert perms(m.path) == 0o644
        time.sleep(ATTR_TIMEOUT_S)  # the directories' and other files' cached attributes expire
        assert perms(mnt) == 0o555 and perms(paths["partition"]) == 0o644
        for kind, p in paths.items():
            assert read_ok(user.run("read", p, offset_of(kind))), kind
        assert user.run("write", m.path, "00", 0) == "EACCES"
        os.chmod(m.path, 0o666)
        assert user.run("write", m.path, "7e" * 4, 4 * MiB) == "ok"
        # Only the view changes; its partitions and snapshots follow it.
        with pytest.raises(PermissionError):
            os.chmod(paths["partition"], 0o600)
        with pytest.raises(PermissionError):
            os.chmod(mnt / "partitions", 0o700)
        os.chown(m.path, user.uid, -1)
        assert os.stat(m.path).st_uid == user.uid
        assert user.run("chmod", m.path, "600") == "EPERM"  # the owner now, but not the mounter
        os.chmod(m.path, 0o600)
        assert user.run("read", m.path, PATTERN_AT) == f"ok {PATTERN.hex()}"  # still the owner
        os.chown(m.path, 0, -1)
        assert user.run("read", m.path, PATTERN_AT) == "EACCES"
    st = os.stat(image)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), "the image file changed"
    helpers.qemu_io(image, f"read -P 0x7e {4 * MiB} 4")
    with helpers.mounted(image, mnt, ["allow_other"]) as m:  # a new mount starts from the image again
        assert perms(m.path) == 0o400 and os.stat(m.path).st_uid == 0


def test_read_only_mount_refuses_chmod(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o600, "raw")
    with helpers.mounted(image, shared / "view.raw", ["allow_other"]) as m:
        with pytest.raises(OSError) as e:  # the kernel refuses every change on a read-only mount
            os.chmod(m.path, 0o644)
        assert e.value.errno == errno.EROFS
        assert perms(m.path) == 0o400
        assert user.run("read", m.path, PATTERN_AT) == "EACCES"


# --------------------------------------------------------------------------
# Without allow_other


def test_without_allow_other_only_the_mounter_gets_in(shared: Path, user: User) -> None:
    image = make_disk(shared, 0o644)
    mnt = shared / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt) as m:
        assert perms(m.path) == 0o444
        assert user.run("list", mnt) == "EACCES"
        assert user.run("read", m.path, PATTERN_AT) == "EACCES"
        with open(m.path, "rb") as f:
            assert os.pread(f.fileno(), 16, PATTERN_AT) == PATTERN
    with helpers.mounted(image, shared / "view.raw", ["umask=0"]) as m:
        assert user.run("read", m.path, PATTERN_AT) == "EACCES"
