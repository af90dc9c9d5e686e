"""Encrypted images through the mount, checked against QEMU with the secret:
raw LUKS1 (qemu-img create -f luks) for every cipher, mode, IV generator and
ESSIV hash qemu-img can create; LUKS2 made by cryptsetup (pbkdf2, argon2id,
4 KiB sectors), checked against an independent decryption (python3-
cryptography with the volume key cryptsetup dumps: this kernel has no
dm-crypt, so `cryptsetup open` cannot be the referee); qcow2 with LUKS (read,
fio writes with --verify, qemu-img check, backing chains both ways,
subclusters); qcow2's legacy AES (read-only, with the warning); and the key
sources: wrong passphrase, no key, a key on a pipe, the prompt on a pty."""

from __future__ import annotations

import concurrent.futures
import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers

KiB, MiB = 1 << 10, 1 << 20
PASS = "correct horse"
SECRET = ["--object", f"secret,id=s0,data={PASS}"]
MARKER = b"QCOWFS-PLAINTEXT-MARKER-0123456789abcdef" * 100


def key_file(workdir: Path) -> Path:
    p = workdir / "pass.txt"
    if not p.exists():
        p.write_text(PASS)
    return p


image_opts = fh.secret_image_opts


def qemu_img_create(fmt: str, image: Path, size: int, opts: str) -> None:
    """qemu-img create with the secret. qemu-img times PBKDF2 from 2^15
    iterations with the thread CPU clock and fails with "Unable to get accurate
    CPU usage" when they take less than a tick: with SHA-NI (sha256, sha1) most
    runs here. So the PBKDF2 hash is sha512 unless opts name one, and that one
    error is retried. The calibration is cut short (helpers.fast_kdf_calibration_env):
    no test here tests qemu-img's key derivation."""
    key = "encrypt.hash-alg" if fmt == "qcow2" else "hash-alg"
    if f",{key}=" not in f",{opts}":
        opts += f",{key}=sha512"
    for attempt in range(8):
        r = helpers.run(["qemu-img", "create", "-q", *SECRET, "-f", fmt, "-o", opts, image, str(size)], check=False,
                        env=helpers.fast_kdf_calibration_env())
        if r.returncode == 0:
            return
        if b"accurate CPU usage" not in r.stderr + r.stdout or attempt == 7:
            raise AssertionError(f"qemu-img create failed: {(r.stderr + r.stdout).decode(errors='replace')}")


def qemu_io(image: Path, fmt: str, *cmds: str) -> None:
    args = ["qemu-io", *SECRET, "--image-opts"]
    for c in cmds:
        args += ["-c", c]
    out = helpers.run([*args, image_opts(image, fmt)]).stdout.decode()
    assert "error" not in out.lower() and "failed" not in out.lower(), out


def reference(image: Path, fmt: str, out: Path) -> Path:
    helpers.run(["qemu-img", "convert", *SECRET, "--image-opts", image_opts(image, fmt), "-O", "raw", out])
    return out


def luks_image(workdir: Path, name: str, opts: str = "", size: int = 4 * MiB, cmds=None) -> Path:
    image = workdir / name
    qemu_img_create("luks", image, size, f"key-secret=s0,iter-time=10{',' + opts if opts else ''}")
    qemu_io(image, "luks", *(cmds if cmds is not None else fh.scattered_writes(size, 64 * KiB)))
    return image


def qcow2_image(workdir: Path, name: str, opts: str = "", size: int = 32 * MiB, cmds=None) -> Path:
    image = workdir / name
    qemu_img_create("qcow2", image, size,
                    f"encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10{',' + opts if opts else ''}")
    qemu_io(image, "qcow2", *(cmds if cmds is not None else fh.scattered_writes(size, 64 * KiB)))
    return image


def assert_view_is(view: Path, ref: Path) -> None:
    assert view.stat().st_size == ref.stat().st_size
    assert helpers.files_equal(view, ref), f"{view} differs from {ref}"


def mount_opts(workdir: Path, *extra: str) -> list[str]:
    return [f"key-file={key_file(workdir)}", *extra]


# Every cipher, mode and IV generator qemu-img 7.2 creates LUKS images with
# (qemu-img itself fails on CBC/CTR with 192-bit keys, and on XTS with
# CAST5's 8-byte blocks; essiv needs a hash as long as a key of the cipher).
COMBOS = [
    "cipher-alg=aes-128,cipher-mode=xts", "cipher-alg=aes-192,cipher-mode=xts",
    "cipher-alg=aes-256,cipher-mode=xts", "cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain",
    "cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=essiv,ivgen-hash-alg=sha256",
    "cipher-alg=aes-128,cipher-mode=cbc", "cipher-alg=aes-256,cipher-mode=cbc,ivgen-alg=plain",
    "cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256",
    "cipher-alg=aes-256,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256",
    "cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=md5",
    "cipher-alg=aes-256,cipher-mode=ecb", "cipher-alg=aes-128,cipher-mode=ctr", "cipher-alg=aes-256,cipher-mode=ctr",
    "cipher-alg=serpent-128,cipher-mode=xts", "cipher-alg=serpent-192,cipher-mode=xts",
    "cipher-alg=serpent-256,cipher-mode=xts", "cipher-alg=serpent-128,cipher-mode=cbc",
    "cipher-alg=serpent-256,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256",
    "cipher-alg=serpent-256,cipher-mode=ctr", "cipher-alg=serpent-256,cipher-mode=ecb",
    "cipher-alg=twofish-128,cipher-mode=xts", "cipher-alg=twofish-192,cipher-mode=xts",
    "cipher-alg=twofish-256,cipher-mode=xts",
    "cipher-alg=twofish-128,cipher-mode=cbc",
    "cipher-alg=twofish-256,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256",
    "cipher-alg=twofish-256,cipher-mode=ctr", "cipher-alg=twofish-128,cipher-mode=ecb",
    "cipher-alg=cast5-128,cipher-mode=cbc", "cipher-alg=cast5-128,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=md5",
    "cipher-alg=cast5-128,cipher-mode=ctr", "cipher-alg=cast5-128,cipher-mode=ecb",
    "hash-alg=ripemd160", "hash-alg=sha384",
]


@pytest.fixture(scope="module")
def combo_images(tmp_path_factory) -> dict[str, Path]:
    """One LUKS1 image per combination, made two at a time (qemu-img create
    spends seconds of CPU timing PBKDF2)."""
    d = tmp_path_factory.mktemp("luks-combos")
    size = 2 * MiB
    def make(i: int, opts: str) -> tuple[str, Path]:
        return opts, luks_image(d, f"c{i}.luks", opts, size, fh.scattered_writes(size, 64 * KiB, seed=i))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(lambda a: make(*a), enumerate(COMBOS)))


@pytest.mark.parametrize("opts", COMBOS)
def test_luks1_every_cipher_as_qemu_reads_and_writes_it(workdir: Path, combo_images, opts: str) -> None:
    """Read-only: the view is qemu-img's plaintext. Read-write: fio --verify
    writes (512 B to 64 KiB, unaligned sizes included), then QEMU reads what
    the mount showed, and the host file holds no plaintext."""
    image = workdir / "c.luks"
    shutil.copyfile(combo_images[opts], image)
    ref = reference(image, "luks", workdir / "ref.raw")
    with helpers.mounted(image, workdir / "view.raw", mount_opts(workdir)) as m:
        assert_view_is(m.path, ref)
    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "rw.raw", mount_opts(workdir, "rw")) as m:
        helpers.run(["fio", "--name=w", f"--filename={m.path}", "--rw=randwrite", "--bsrange=512-64k",
                     "--size=1M", "--ioengine=psync", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1"],
                    timeout=120)
        write_marker(m.path, [1536 * KiB + 7])
        shutil.copyfile(m.path, copy)
    assert_view_is(copy, reference(image, "luks", workdir / "after.raw"))
    assert_no_plaintext(image)


def fio_write_verify(path: Path, size: str, rw: str = "randwrite") -> None:
    if shutil.which("fio") is None:
        pytest.fail("fio is not installed (tests/setup-deps.sh)")
    helpers.run(["fio", "--name=w", f"--filename={path}", f"--rw={rw}", "--bsrange=512-1m", "--bs_unaligned=0",
                 f"--size={size}", "--ioengine=libaio", "--iodepth=32", "--direct=1", "--verify=crc32c",
                 "--do_verify=1", "--verify_fatal=1", "--fsync=64"], timeout=300)


def write_marker(view: Path, offsets: list[int]) -> None:
    fd = os.open(view, os.O_WRONLY)
    try:
        for off in offsets:
            os.pwrite(fd, MARKER, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def assert_no_plaintext(image: Path) -> None:
    data = image.read_bytes()
    assert MARKER[:40] not in data, f"plaintext found in {image}"


@pytest.mark.parametrize("opts", ["", "cipher-alg=serpent-256,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256"],
                         ids=["aes-xts", "serpent-cbc-essiv"])
def test_luks1_read_write(workdir: Path, opts: str) -> None:
    """fio with --verify through a rw mount, unaligned writes, growth; QEMU
    then reads what the mount shows, and no plaintext is on the host."""
    image = luks_image(workdir, "rw.luks", opts, 64 * MiB, ["write -P 0x77 1M 1M"])
    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "view.raw", mount_opts(workdir, "rw", "cache=none")) as m:
        fio_write_verify(m.path, "48M")
        fd = os.open(m.path, os.O_WRONLY)
        os.pwrite(fd, b"\xab" * 700, 50 * MiB + 100)  # cuts two sectors
        os.close(fd)
        write_marker(m.path, [52 * MiB, 52 * MiB + 4096 + 7])
        os.truncate(m.path, 80 * MiB)
        shutil.copyfile(m.path, copy)
    assert copy.stat().st_size == 80 * MiB
    with open(copy, "rb") as f:
        f.seek(64 * MiB)
        assert f.read(16 * MiB) == bytes(16 * MiB), "the grown range does not read as zeros"
        f.seek(50 * MiB + 100)
        assert f.read(700) == b"\xab" * 700
    assert_view_is(copy, reference(image, "luks", workdir / "ref.raw"))
    assert_no_plaintext(image)
    with helpers.mounted(image, workdir / "view2.raw", mount_opts(workdir)) as m:
        assert_view_is(m.path, copy)


def cryptsetup_luks2(workdir: Path, name: str, *args: str, size: int = 32 * MiB) -> Path:
    image = workdir / name
    with open(image, "wb") as f:
        f.truncate(size)
    # Fixed KDF costs (cryptsetup's minimums: 1000 PBKDF2 iterations, 4 Argon2
    # passes) instead of --iter-time, whose benchmark costs 2-3 s of CPU per image.
    iterations = "1000" if "pbkdf2" in args else "4"
    helpers.run(["cryptsetup", "luksFormat", "--type", "luks2", "--batch-mode", "--pbkdf-force-iterations", iterations,
                 "--key-file", key_file(workdir), *args, image])
    return image


def luks2_reference(image: Path, workdir: Path, length: int) -> bytes:
    """The payload decrypted independently: the volume key from cryptsetup,
    AES-XTS from python3-cryptography, IVs per sector as dm-crypt counts them."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    dump = helpers.run(["cryptsetup", "luksDump", "-q", "--dump-master-key", "--key-file", key_file(workdir),
                        image]).stdout.decode()
    hexkey, in_key = "", False
    for line in dump.splitlines():
        if line.startswith("MK dump:"):
            in_key, line = True, line[len("MK dump:"):]
        elif in_key and not line.startswith("\t"):
            in_key = False
        if in_key:
            hexkey += line.replace(" ", "").strip()
    key = bytes.fromhex(hexkey)
    info = helpers.run(["cryptsetup", "luksDump", image]).stdout.decode()
    offset = sector = None
    for line in info.splitlines():
        s = line.strip()
        if s.startswith("offset:") and offset is None:
            offset = int(s.split()[1])
        if s.startswith("sector:") and sector is None:
            sector = int(s.split()[1])
    assert offset is not None and sector is not None, info
    with open(image, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    out = bytearray()
    for i in range(0, length, sector):
        dec = Cipher(algorithms.AES(key), modes.XTS((i // sector).to_bytes(16, "little"))).decryptor()
        out += dec.update(data[i:i + sector]) + dec.finalize()
    return bytes(out)


@pytest.mark.parametrize("args", [
    ["--pbkdf", "pbkdf2"],
    ["--pbkdf", "argon2id", "--pbkdf-memory", "1024"],
    ["--pbkdf", "argon2id", "--pbkdf-memory", "1024", "--sector-size", "4096"],
], ids=["pbkdf2", "argon2id", "argon2id-4k-sectors"])
def test_luks2_from_cryptsetup_read_write(workdir: Path, args: list[str]) -> None:
    image = cryptsetup_luks2(workdir, "c2.img", *args)
    with helpers.mounted(image, workdir / "view.raw", mount_opts(workdir, "rw")) as m:
        size = m.path.stat().st_size
        assert 0 < size < 32 * MiB
        fio_write_verify(m.path, "8M", "write")
        write_marker(m.path, [8 * MiB, 9 * MiB + 4096])
        with open(m.path, "rb") as f:
            view = f.read(10 * MiB)
    assert luks2_reference(image, workdir, 10 * MiB) == view
    assert_no_plaintext(image)
    with helpers.mounted(image, workdir / "view2.raw", mount_opts(workdir)) as m:
        with open(m.path, "rb") as f:
            assert f.read(10 * MiB) == view


@pytest.mark.parametrize("opts", ["", "cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256",
                                  "extended_l2=on,cluster_size=128k"],
                         ids=["aes-xts", "aes-cbc-essiv", "subclusters"])
def test_qcow2_luks_reads_as_qemu_reads_it(workdir: Path, opts: str) -> None:
    enc = ",".join(f"encrypt.{o}" if o.startswith(("cipher", "ivgen")) else o for o in opts.split(",") if o)
    image = qcow2_image(workdir, "e.qcow2", enc)
    ref = reference(image, "qcow2", workdir / "ref.raw")
    with helpers.mounted(image, workdir / "view.raw", mount_opts(workdir)) as m:
        assert_view_is(m.path, ref)


@pytest.mark.parametrize("kind", ["plain", "subclusters", "over-plain-backing"])
def test_qcow2_luks_read_write(workdir: Path, kind: str) -> None:
    """fio --verify through the mount; afterwards qemu-img check is clean,
    QEMU reads what the mount showed and the host file holds no plaintext."""
    opts = {"plain": "", "subclusters": "extended_l2=on", "over-plain-backing": ""}[kind]
    if kind == "over-plain-backing":
        base = fh.make_image(workdir, "qcow2", "base.qcow2", 64 * MiB, "", ["write -P 0x5c 0 64M"])
        opts = f"backing_file={base},backing_fmt=qcow2"
    image = workdir / "e.qcow2"
    qemu_img_create("qcow2", image, 64 * MiB,
                    f"encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10{',' + opts if opts else ''}")
    copy = workdir / "copy.raw"
    with helpers.mounted(image, workdir / "view.raw", mount_opts(workdir, "rw", "cache=none")) as m:
        fio_write_verify(m.path, "40M")
        fd = os.open(m.path, os.O_WRONLY)
        os.pwrite(fd, b"\xcd" * 1000, 45 * MiB + 300)  # a partial-sector write into a fresh cluster
        os.close(fd)
        write_marker(m.path, [50 * MiB, 50 * MiB + 64 * KiB - 20])
        shutil.copyfile(m.path, copy)
    check = helpers.run(["qemu-img", "check", *SECRET, "--image-opts", image_opts(image, "qcow2")], check=False)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert_view_is(copy, reference(image, "qcow2", workdir / "ref.raw"))
    assert_no_plaintext(image)
    with open(copy, "rb") as f:
        f.seek(45 * MiB)
        head = f.read(300)
        assert head == (b"\x5c" * 300 if kind == "over-plain-backing" else bytes(300))


def test_qcow2_plain_over_encrypted_backing(workdir: Path) -> None:
    base = qcow2_image(workdir, "base.qcow2", "", 32 * MiB, ["write -P 0x61 0 32M"])
    top = workdir / "top.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top, str(32 * MiB)])
    helpers.run(["qemu-io", *SECRET, "--image-opts", "-c", "write -P 0x62 1M 64k",
                 f"driver=qcow2,file.filename={top},backing.encrypt.key-secret=s0"])
    ref = workdir / "ref.raw"
    helpers.run(["qemu-img", "convert", *SECRET, "--image-opts",
                 f"driver=qcow2,file.filename={top},backing.encrypt.key-secret=s0", "-O", "raw", ref])
    with helpers.mounted(top, workdir / "view.raw", mount_opts(workdir)) as m:
        assert_view_is(m.path, ref)


def test_qcow2_legacy_aes_is_read_only_with_a_warning(workdir: Path) -> None:
    image = workdir / "aes.qcow2"
    helpers.run(["qemu-img", "create", "-q", *SECRET, "-f", "qcow2", "-o", "encrypt.format=aes,encrypt.key-secret=s0",
                 image, str(16 * MiB)])
    helpers.run(["qemu-io", *SECRET, "--image-opts", "-c", "write -P 0x33 0 64k", "-c", "write -P 0x34 5M 4k",
                 f"driver=qcow2,encrypt.key-secret=s0,file.filename={image}"])
    ref = reference(image, "qcow2", workdir / "ref.raw")
    with helpers.mounted(image, workdir / "view.raw", mount_opts(workdir)) as m:
        assert_view_is(m.path, ref)
        with open(m.path, "rb") as f:
            f.seek(5 * MiB + 100)
            assert f.read(1000) == b"\x34" * 1000  # unaligned: whole sectors decrypted around it
    assert "weak" in m.final_log, m.final_log
    _, text = helpers.mount_fails(image, workdir / "view2.raw", mount_opts(workdir, "rw"))
    assert "read-only" in text, text


def test_wrong_passphrase_is_refused_and_nothing_written(workdir: Path) -> None:
    image = luks_image(workdir, "w.luks", "", 1 * MiB, ["write -P 0x12 0 4k"])
    before = helpers.sha256_file(image)
    bad = workdir / "bad.txt"
    bad.write_text("wrong")
    _, text = helpers.mount_fails(image, workdir / "view.raw", [f"key-file={bad}", "rw"])
    assert "wrong passphrase" in text, text
    assert helpers.sha256_file(image) == before
    qimage = qcow2_image(workdir, "w.qcow2", "", 8 * MiB, ["write -P 0x12 0 4k"])
    before = helpers.sha256_file(qimage)
    _, text = helpers.mount_fails(qimage, workdir / "view2.raw", [f"key-file={bad}", "rw"])
    assert "wrong passphrase" in text, text
    assert helpers.sha256_file(qimage) == before


def test_key_file_ending_in_a_newline_is_refused_with_a_note(workdir: Path) -> None:
    """`echo pw > f` (issue 31): the newline is part of the passphrase, as for
    cryptsetup, so the mount is refused, but the message says why; the exact
    bytes mount. A FIFO as key file is refused at once, not waited on."""
    image = luks_image(workdir, "n.luks", "", 1 * MiB, ["write -P 0x5a 0 4k"])
    echoed = workdir / "echoed.txt"
    echoed.write_text(PASS + "\n")
    _, text = helpers.mount_fails(image, workdir / "view.raw", [f"key-file={echoed}"])
    assert "wrong passphrase" in text and "key file ends in a newline" in text, text
    exact = workdir / "exact.txt"
    exact.write_text(PASS)
    with helpers.mounted(image, workdir / "view2.raw", [f"key-file={exact}"]) as m:
        with open(m.path, "rb") as f:
            assert f.read(4096) == b"\x5a" * 4096
    fifo = workdir / "key.fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    _, text = helpers.mount_fails(image, workdir / "view3.raw", [f"key-file={fifo}"])
    assert f"key file {fifo} is a FIFO, not a regular file" in text, text
    # Refused without blocking; the bound is generous for a loaded machine (the open used to hang forever).
    assert time.monotonic() - start < 10


def test_missing_key_without_a_terminal_says_how_to_give_one(workdir: Path) -> None:
    image = luks_image(workdir, "m.luks", "", 1 * MiB, [])
    _, text = helpers.mount_fails(image, workdir / "view.raw")
    assert "key-file" in text, text


def test_key_on_a_pipe(workdir: Path) -> None:
    image = luks_image(workdir, "p.luks", "", 1 * MiB, ["write -P 0x44 0 4k"])
    view = workdir / "view.raw"
    view.touch()
    proc = subprocess.Popen([helpers.qcowfs_bin(), "-f", "-o", "key-file=-", image, view], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.stdin.write(PASS.encode())
        proc.stdin.close()
        wait_mounted(view, proc)
        with open(view, "rb") as f:
            assert f.read(4096) == b"\x44" * 4096
    finally:
        helpers.unmount(view)
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode(errors="replace")


def wait_mounted(view: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not helpers.is_fuse_mounted(view):
        if proc.poll() is not None or time.monotonic() > end:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"qcowfs did not mount (exit {proc.poll()}): {out}")
        time.sleep(0.05)


def test_prompt_on_a_terminal(workdir: Path) -> None:
    """No key given, a terminal on standard input: the passphrase is asked
    for without echo, and the mount comes up with it."""
    image = luks_image(workdir, "t.luks", "", 1 * MiB, ["write -P 0x55 0 4k"])
    view = workdir / "view.raw"
    view.touch()
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(helpers.qcowfs_bin(), [helpers.qcowfs_bin(), "-f", str(image), str(view)])
    out = b""
    try:
        end = time.monotonic() + 30
        while b"assphrase" not in out and time.monotonic() < end:
            if select.select([fd], [], [], 0.5)[0]:
                out += os.read(fd, 4096)
        assert b"assphrase" in out, out
        os.write(fd, (PASS + "\n").encode())
        end = time.monotonic() + 30
        while not helpers.is_fuse_mounted(view) and time.monotonic() < end:
            if select.select([fd], [], [], 0.1)[0]:
                out += os.read(fd, 4096)
        assert helpers.is_fuse_mounted(view), out
        assert PASS.encode() not in out, "the passphrase was echoed"
        with open(view, "rb") as f:
            assert f.read(4096) == b"\x55" * 4096
    finally:
        helpers.unmount(view)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, out
