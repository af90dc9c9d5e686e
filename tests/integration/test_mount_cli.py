"""What the qcowfs command says and does around a mount (issue 31):

- Without -f the command returns only once the mount is up (exit 0) or has
  failed (non-zero, the reason on stderr), through qcowfs itself and through
  mount(8) -> mount.fuse3 (the `-t fuse PROGRAM#IMAGE` form, since mount(8)
  runs helpers with a fixed PATH that does not hold the binary under test).
- Once daemonized, messages go to -o log=FILE (or syslog; without /dev/log a
  warning at mount time says they would be lost).
- A mount point that already holds a FUSE mount is refused.
- --help names every format of the registry (image/formats.cc, read here).
- qemu-img command names and `help` are answered as commands, not images.
- format=NAME naming the wrong format says what the file's bytes look like.
- run.sh's view_name() strips the suffixes qcowfs strips (fuse/inode_table.cc).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

from qcowfs_testlib import helpers
from qcowfs_testlib import qcow2_meta

MiB = 1 << 20
URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")


def run_mount(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs a backgrounding mount command; it must return by itself."""
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=helpers.MOUNT_TIMEOUT_S * 2)


def assert_refused(argv: list[str], target: Path, reason: str) -> None:
    proc = run_mount(argv)
    mounted = helpers.is_fuse_mounted(target)
    if mounted:
        helpers.unmount(target)
    assert not mounted, f"{argv} left a mount behind (exit {proc.returncode}):\n{proc.stderr}"
    assert proc.returncode != 0, f"{argv} exited 0 although the mount failed:\n{proc.stderr}"
    assert re.search(reason, proc.stderr), f"{argv}: reason /{reason}/ not on stderr:\n{proc.stderr}"


def refused_both_ways(qcowfs: str, image: Path, target: Path, opts: str, reason: str) -> None:
    """Refused by `qcowfs -o OPTS IMAGE DIR` and by `mount -t fuse` (both daemonizing)."""
    assert_refused([qcowfs, "-o", opts, str(image), str(target)], target, reason)
    assert_refused(["mount", "-t", "fuse", f"{qcowfs}#{image}", str(target), "-o", opts], target, reason)


@contextlib.contextmanager
def fuse_uring_disabled():
    """fuse.enable_uring=N for the block (restored after); kernels without the
    parameter have no FUSE over io_uring at all, which refuses the same way."""
    old = URING_PARAM.read_text().strip() if URING_PARAM.exists() else None
    if old is not None:
        URING_PARAM.write_text("N")
    try:
        yield
    finally:
        if old is not None:
            URING_PARAM.write_text(old)


def make_qcow2(workdir: Path, name: str = "disk.qcow2") -> Path:
    img = workdir / name
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, "4M")
    helpers.qemu_io(img, "write -P 0x5a 0 128k")
    return img


def test_background_mount_failures_exit_nonzero_with_the_reason(workdir: Path, qcowfs: str) -> None:
    good = make_qcow2(workdir)
    mnt = workdir / "mnt"
    mnt.mkdir()
    # fuse_uring=on without kernel support fails after the mount, at ring
    # registration: the command used to exit 0 with nothing mounted.
    with fuse_uring_disabled():
        refused_both_ways(qcowfs, good, mnt, "ro,fuse_uring=on", r"fuse_uring=on.*unavailable")
    corrupt = workdir / "corrupt.qcow2"
    corrupt.write_bytes(good.read_bytes())
    with open(corrupt, "r+b") as f:  # cluster_bits (header offset 20) out of range
        f.seek(20)
        f.write(b"\x00\x00\x00\x40")
    refused_both_ways(qcowfs, corrupt, mnt, "ro", r"cluster_bits")
    luks = workdir / "secret.luks"
    luks.write_bytes(bytes(4 * MiB))
    right, wrong = workdir / "right.key", workdir / "wrong.key"
    right.write_bytes(b"right passphrase")
    wrong.write_bytes(b"wrong passphrase")
    helpers.run(["cryptsetup", "luksFormat", "-q", "--type", "luks1", "--pbkdf-force-iterations", "1000",
                 "--key-file", right, luks])
    refused_both_ways(qcowfs, luks, mnt, f"ro,key-file={wrong}", r"wrong passphrase")
    refused_both_ways(qcowfs, good, mnt, "ro,cache=sometimes", r"bad value 'sometimes' for option cache")
    refused_both_ways(qcowfs, good, mnt, f"ro,log={workdir}/no/such/dir/qcowfs.log", r"log file .*No such file")
    # The right key mounts: the refusal above was the key's.
    with helpers.mounted(luks, workdir / "view", [f"key-file={right}"], foreground=False) as m:
        assert m.path.stat().st_size > 0


def test_log_file_records_a_later_eio_and_the_default_warns_without_syslog(workdir: Path) -> None:
    img = make_qcow2(workdir)
    q = qcow2_meta.Qcow2(img)
    l1, l2 = q.first_data_entry()
    q.put_u64(q.l2_entry_offset(l1, l2), qcow2_meta.COPIED | (1 << 40))  # data cluster past EOF
    log = workdir / "qcowfs.log"
    log.write_text("earlier line\n")
    with helpers.mounted(img, workdir / "view", [f"log={log}"], foreground=False) as m:
        fd = os.open(m.path, os.O_RDONLY)
        try:
            os.pread(fd, 4096, 0)
            raise AssertionError("reading the cluster past EOF did not fail")
        except OSError as e:
            assert e.errno == 5, e
        finally:
            os.close(fd)
        assert "syslog" not in m.stderr(), m.stderr()
    text = log.read_text()
    assert text.startswith("earlier line\n"), "log=FILE must append"
    assert re.search(r"qcowfs\[\d+\]: error: .*corrupt qcow2 metadata for guest offset 0x0.*beyond the end", text), text
    # Without log=: syslog if there is a socket, else a warning at mount time.
    with helpers.mounted(make_qcow2(workdir, "plain.qcow2"), workdir / "view2", foreground=False) as m:
        warned = "no syslog socket (/dev/log)" in m.stderr() and "-o log=FILE" in m.stderr()
        assert warned == (not os.path.exists("/dev/log")), m.stderr()


def test_mounting_twice_on_one_mount_point_is_refused(workdir: Path, qcowfs: str) -> None:
    img = make_qcow2(workdir)
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(img, mnt, foreground=False):
        proc = run_mount([qcowfs, str(img), str(mnt)])
        assert proc.returncode != 0, proc.stderr
        assert f"{mnt} is already mounted" in proc.stderr, proc.stderr
        assert helpers.mountinfo_targets().count(os.path.realpath(mnt)) == 1, "a second mount was stacked"


def registry_formats() -> tuple[list[str], list[str]]:
    """(opened, recognised-only) format names from image/formats.cc's table."""
    src = (helpers.REPO_ROOT / "image" / "formats.cc").read_text()
    rows = re.findall(r'FormatInfo\{\.name = "([a-z0-9]+)",\s*\.display = "[^"]*",\s*\.open = (\w+)', src)
    assert len(rows) >= 10, f"could not read the format table: {rows}"
    return [n for n, fn in rows if fn != "nullptr"], [n for n, fn in rows if fn == "nullptr"]


def test_help_names_every_registry_format(workdir: Path, qcowfs: str) -> None:
    opened, refused = registry_formats()
    text = helpers.run([qcowfs, "--help"]).stdout.decode()
    assert "qcow2 or raw" not in text
    para = re.search(r"^  format=FMT(.*?)^  key-file=", text, re.S | re.M)
    assert para, text
    words = set(re.findall(r"[a-z0-9]+", para.group(1)))
    missing = [n for n in opened + refused if n not in words]
    assert not missing, f"--help's format= entry lacks {missing}:\n{para.group(0)}"
    refused_part = para.group(1).split("refused:", 1)
    assert len(refused_part) == 2 and set(re.findall(r"[a-z0-9]+", refused_part[1])) == set(refused), para.group(0)
    help_cmd = subprocess.run([qcowfs, "help"], capture_output=True, text=True, cwd=workdir)
    assert help_cmd.returncode == 0 and help_cmd.stdout == text


def test_foreign_command_names_are_unknown_commands(workdir: Path, qcowfs: str) -> None:
    img = make_qcow2(workdir)
    for argv in (["amend", "-o", "compat=1.1", str(img)], ["rebase", "-b", "x", str(img)], ["convert", str(img), "out.raw"],
                 ["frobnicate"], ["help", "rebase"]):
        proc = subprocess.run([qcowfs, *argv], capture_output=True, text=True, cwd=workdir, timeout=30)
        name = argv[1] if argv[0] == "help" else argv[0]
        assert proc.returncode == 1, (argv, proc.stderr)
        assert f"qcowfs: unknown command '{name}'" in proc.stderr, proc.stderr
        assert "create, info, check, map, resize, snapshot" in proc.stderr, proc.stderr
    assert not (workdir / "out.raw").exists()
    info = subprocess.run([qcowfs, "help", "info"], capture_output=True, text=True)
    assert info.returncode == 0 and info.stdout.startswith("usage: qcowfs info"), info.stdout


def test_format_typo_says_what_the_bytes_look_like(workdir: Path, qcowfs: str) -> None:
    img = make_qcow2(workdir)
    _, text = helpers.mount_fails(img, workdir / "view", ["format=qcow"])
    assert "looks like a qcow2 image; did you mean format=qcow2" in text, text
    assert "format=raw" not in text, text  # that would serve the container as the disk
    info = subprocess.run([qcowfs, "info", "-f", "qcow", str(img)], capture_output=True, text=True)
    assert info.returncode != 0 and "did you mean format=qcow2" in info.stderr, info.stderr


def run_sh_view_name(image: str) -> str:
    """view_name() from run.sh, run by bash on its own."""
    src = (helpers.REPO_ROOT / "run.sh").read_text()
    fn = re.search(r"^view_name\(\) \{\n.*?^\}\n", src, re.S | re.M)
    assert fn, "run.sh has no view_name()"
    out = subprocess.run(["bash", "-c", fn.group(0) + 'view_name "$1"', "bash", image],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_run_sh_view_name_matches_qcowfs(workdir: Path) -> None:
    src = (helpers.REPO_ROOT / "fuse" / "inode_table.cc").read_text()
    table = re.search(r"kSuffixes = \{(.*?)\};", src, re.S)
    assert table, "fuse/inode_table.cc has no kSuffixes"
    suffixes = re.findall(r'"(\.[a-z0-9]+)"', table.group(1))
    assert ".vmdk" in suffixes and ".luks" in suffixes, suffixes
    for s in suffixes:
        assert run_sh_view_name(f"/images/disk{s}") == "disk.raw", s
    assert run_sh_view_name("/images/disk.iso") == "disk.iso.raw"
    # The real thing: a raw image named like a VMDK, viewed in directory mode.
    img = workdir / "disk.vmdk"
    img.write_bytes(bytes(1 * MiB))
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(img, mnt, ["format=raw"]):
        assert run_sh_view_name(str(img)) in os.listdir(mnt), os.listdir(mnt)
