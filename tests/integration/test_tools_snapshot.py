"""`qcowfs snapshot -l|-c|-a|-d` against `qemu-img snapshot` (QEMU 7.2).

QEMU is the referee: after every qcowfs operation `qemu-img check` finds the
image clean (no corruptions, no leaks), `qemu-img snapshot -l` prints the
same listing as `qcowfs snapshot -l`, each snapshot converted by qemu-img
(`convert -l snapshot.name=X`) reads the bytes written before it was taken,
and an applied snapshot compares equal to them. Operations qemu-img makes on
a copy of the same image give the same snapshot table. Refusals (raw images,
an external data file, unknown names, mixed actions, applying with dirty
bitmaps, a mounted image whose control socket is gone, a snapshot table pointing outside the file) give qemu-img's messages and exit
codes, and leave the file unchanged. Images are a few MiB.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from qcowfs_testlib import helpers

MiB = 1 << 20
PASS = "snapshot-pass"
SECRET = ["--object", f"secret,id=s0,data={PASS}"]


def qcowfs_snapshot(*args) -> subprocess.CompletedProcess:
    return helpers.run([helpers.qcowfs_bin(), "snapshot", *args], check=False)


def qemu_snapshot(*args) -> subprocess.CompletedProcess:
    return helpers.run(["qemu-img", "snapshot", *args], check=False)


def ok(*args) -> str:
    r = qcowfs_snapshot(*args)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


def listing(image: Path) -> str:
    """qemu-img's listing; qcowfs must print exactly the same."""
    theirs = qemu_snapshot("-l", image)
    assert theirs.returncode == 0, theirs.stderr.decode()
    assert ok("-l", image) == theirs.stdout.decode()
    return theirs.stdout.decode()


def tags(image: Path) -> list[tuple[str, str]]:
    return [(s["id"], s["name"]) for s in helpers.qemu_img_info(image).get("snapshots", [])]


def message(proc: subprocess.CompletedProcess, prefix: str) -> str:
    text = proc.stderr.decode()
    assert text.startswith(prefix), text
    return text[len(prefix):].strip()


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def new_image(workdir: Path, name: str = "disk.qcow2", *opts: str) -> Path:
    image = workdir / name
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", *opts, image, "4M"])
    return image


def test_create_apply_delete_round_trip(workdir):
    image = new_image(workdir)
    helpers.qemu_io(image, "write -P 0x11 0 256k", "write -P 0x12 3M 64k")
    before_s1 = helpers.convert_to_raw(image, workdir / "s1.raw")
    ok("-c", "s1", image)
    helpers.qemu_img_check(image)
    helpers.qemu_io(image, "write -P 0x21 64k 128k", "write -P 0x22 1M 512k")
    before_s2 = helpers.convert_to_raw(image, workdir / "s2.raw")
    ok("-q", "-c", "s2", image)
    helpers.qemu_img_check(image)
    helpers.qemu_io(image, "write -P 0x31 0 1M")
    current = helpers.convert_to_raw(image, workdir / "current.raw")

    assert tags(image) == [("1", "s1"), ("2", "s2")]
    assert listing(image).startswith("Snapshot list:\nID        TAG  ")
    for snap, expected in (("s1", before_s1), ("s2", before_s2)):
        got = helpers.convert_to_raw(image, workdir / f"got-{snap}.raw", snapshot=snap)
        assert helpers.files_equal(got, expected), snap

    ok("-a", "s1", image)  # by name
    helpers.qemu_img_check(image)
    helpers.run(["qemu-img", "compare", "-q", "-F", "raw", image, before_s1])
    ok("-a", "2", image)  # by ID, as QEMU looks IDs up first
    helpers.qemu_img_check(image)
    helpers.run(["qemu-img", "compare", "-q", "-F", "raw", image, before_s2])
    assert helpers.sha256_file(before_s2) != helpers.sha256_file(current)

    # s1's own clusters (0x11 data overwritten since) go with it: punched, no leaks.
    used = allocated_bytes(image)
    ok("-d", "s1", image)
    helpers.qemu_img_check(image)
    assert tags(image) == [("2", "s2")]
    assert allocated_bytes(image) < used
    helpers.run(["qemu-img", "compare", "-q", "-F", "raw", image, before_s2])
    ok("-d", "s2", image)
    helpers.qemu_img_check(image)
    assert tags(image) == []
    assert listing(image) == ""
    helpers.run(["qemu-img", "compare", "-q", "-F", "raw", image, before_s2])


def test_same_table_as_qemu_img_and_qemu_made_snapshots(workdir):
    ours = new_image(workdir)
    helpers.qemu_io(ours, "write -P 1 0 128k")
    # qemu-img makes two snapshots of the same name (it allows that) ...
    assert qemu_snapshot("-c", "dup", ours).returncode == 0
    helpers.qemu_io(ours, "write -P 2 0 64k")
    assert qemu_snapshot("-c", "dup", ours).returncode == 0
    theirs = workdir / "theirs.qcow2"
    shutil.copyfile(ours, theirs)
    # ... and both tools, on copies, add one, apply one and delete by name
    # (the first "dup", as qemu-img's name lookup finds it).
    for args in (["-c", "dup"], ["-a", "1"], ["-d", "dup"]):
        ok(*args, ours)
        r = qemu_snapshot(*args, theirs)
        assert r.returncode == 0, r.stderr.decode()
        helpers.qemu_img_check(ours)
        assert tags(ours) == tags(theirs), args
        helpers.run(["qemu-img", "compare", "-q", ours, theirs])
    assert tags(ours) == [("2", "dup"), ("3", "dup")]
    # Dates differ for the one each tool made; IDs, names, sizes do not.
    strip = lambda text: [line.split()[:4] for line in text.splitlines()]
    assert strip(listing(ours)) == strip(listing(theirs))


def test_compressed_extended_l2_and_size_change(workdir):
    raw = workdir / "src.raw"
    helpers.run(["qemu-img", "create", "-q", "-f", "raw", raw, "4M"])
    helpers.qemu_io(raw, "write -P 5 0 1M", fmt="raw")
    compressed = workdir / "c.qcow2"
    helpers.run(["qemu-img", "convert", "-c", "-O", "qcow2", raw, compressed])
    ok("-c", "packed", compressed)
    helpers.qemu_io(compressed, "write -P 6 0 64k")
    helpers.qemu_img_check(compressed)
    ok("-a", "packed", compressed)
    helpers.run(["qemu-img", "compare", "-q", compressed, raw])
    ok("-d", "packed", compressed)
    assert helpers.qemu_img_check(compressed)["compressed-clusters"] > 0

    ext = new_image(workdir, "x.qcow2", "-o", "extended_l2=on")
    helpers.qemu_io(ext, "write -P 1 4k 4k")
    ok("-c", "sub", ext)
    helpers.qemu_io(ext, "write -P 2 4k 8k")
    helpers.qemu_img_check(ext)
    ok("-a", "sub", ext)
    helpers.qemu_io(ext, "read -P 1 4k 4k", "read -P 0 8k 4k")
    ok("-d", "sub", ext)
    helpers.qemu_img_check(ext)

    # A snapshot taken at 4 MiB, applied after a grow (past the L1 table's
    # cluster): the disk is 4 MiB again, as qemu-img leaves it.
    ours = new_image(workdir, "grown.qcow2")
    helpers.qemu_io(ours, "write -P 1 0 64k")
    ok("-c", "small", ours)
    helpers.run(["qemu-img", "resize", "-q", ours, "600M"])
    helpers.qemu_io(ours, "write -P 2 500M 64k")
    ok("-c", "big", ours)
    theirs = workdir / "grown-qemu.qcow2"
    shutil.copyfile(ours, theirs)
    for snap in ("small", "big"):
        ok("-a", snap, ours)
        assert qemu_snapshot("-a", snap, theirs).returncode == 0
        helpers.qemu_img_check(ours)
        assert helpers.qemu_img_info(ours)["virtual-size"] == helpers.qemu_img_info(theirs)["virtual-size"]
        helpers.run(["qemu-img", "compare", "-q", ours, theirs])


def test_encrypted_qcow2_needs_no_passphrase(workdir):
    image = workdir / "enc.qcow2"
    helpers.run(["qemu-img", "create", "-q", *SECRET, "-f", "qcow2", "-o",
                 "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10", image, "4M"],
                env=helpers.fast_kdf_calibration_env())  # qemu-img's calibration fails now and then otherwise
    opts = f"driver=qcow2,file.filename={image},encrypt.key-secret=s0"
    helpers.run(["qemu-io", *SECRET, "--image-opts", "-c", "write -P 7 0 64k", opts])
    ok("-c", "e1", image)
    helpers.run(["qemu-io", *SECRET, "--image-opts", "-c", "write -P 8 0 64k", opts])
    ok("-a", "e1", image)
    out = helpers.run(["qemu-io", *SECRET, "--image-opts", "-c", "read -P 7 0 64k", opts]).stdout.decode()
    assert "Pattern verification failed" not in out
    check = helpers.run(["qemu-img", "check", *SECRET, "--image-opts", opts], check=False)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    theirs = qemu_snapshot(*SECRET, "--image-opts", "-l", opts)
    assert theirs.returncode == 0 and theirs.stdout.decode() == ok("-l", image)


def test_refusals_match_qemu_img(workdir):
    raw = workdir / "r.raw"
    helpers.run(["qemu-img", "create", "-q", "-f", "raw", raw, "1M"])
    datafile = new_image(workdir, "d.qcow2", "-o", f"data_file={workdir / 'd.data'}")
    plain = new_image(workdir, "p.qcow2")
    bitmapped = new_image(workdir, "b.qcow2")
    assert qemu_snapshot("-c", "s", bitmapped).returncode == 0
    helpers.run(["qemu-img", "bitmap", "--add", bitmapped, "b0"])
    cases = [(raw, a) for a in (["-c", "x"], ["-a", "x"], ["-d", "x"], ["-l"])]
    cases += [(datafile, a) for a in (["-c", "x"], ["-a", "x"], ["-d", "x"], ["-l"])]
    cases += [(plain, a) for a in (["-a", "nope"], ["-d", "nope"], ["-l", "-c", "x"])]
    cases += [(bitmapped, ["-a", "s"])]  # QEMU: "Device has active dirty bitmaps"
    for image, args in cases:
        before = helpers.sha256_file(image)
        # Named raw, so that qemu-img prints no probing warning (it has no -f).
        named = ["--image-opts", f"driver=raw,file.filename={image}"] if image == raw else [image]
        ours = qcowfs_snapshot(*(["-f", "raw"] if image == raw else []), *args, image)
        assert helpers.sha256_file(image) == before, (image.name, args)  # (qemu-img rewrites bitmaps)
        theirs = qemu_snapshot(*args, *named)
        assert ours.returncode == theirs.returncode, (image.name, args, ours.stderr, theirs.stderr)
        assert ours.stdout == theirs.stdout, (image.name, args)
        if theirs.returncode:
            assert message(ours, "qcowfs snapshot: ").splitlines()[0] == \
                message(theirs, "qemu-img: ").splitlines()[0], (image.name, args)


def test_mounted_image_refused_and_hostile_table(workdir):
    image = new_image(workdir)
    helpers.qemu_io(image, "write -P 3 0 64k")
    ok("-c", "s", image)
    before = helpers.sha256_file(image)
    with helpers.mounted(image, workdir / "mnt", ["rw"]):
        # Without the mount's control socket (test_live_snapshot.py uses it)
        # the command opens the image itself and meets the mount's lock.
        st = os.stat(image)
        os.unlink(f"/run/qcowfs/{st.st_dev:x}-{st.st_ino:x}.sock")
        for args in (["-c", "x"], ["-a", "s"], ["-d", "s"]):
            r = qcowfs_snapshot(*args, image)
            assert r.returncode == 1
            assert 'failed to get "write" lock' in r.stderr.decode(), r.stderr.decode()
        r = qcowfs_snapshot("-l", image)
        assert r.returncode == 1 and 'shared "write" lock' in r.stderr.decode()
        assert "         s " in ok("-U", "-l", image)
        r = qcowfs_snapshot("-U", "-c", "x", image)
        assert r.returncode == 1 and "force-share=on can only be used with read-only images" in r.stderr.decode()
    assert helpers.sha256_file(image) == before

    # The snapshot's L1 table named 4 GiB into a file of less than 1 MiB.
    with open(image, "r+b") as f:
        f.seek(64)
        table = int.from_bytes(f.read(8), "big")
        f.seek(table)
        f.write((4 << 30).to_bytes(8, "big"))
    before = helpers.sha256_file(image)
    for args in (["-l"], ["-c", "x"], ["-a", "s"], ["-d", "s"]):
        r = qcowfs_snapshot(*args, image)
        assert r.returncode == 1, args
        assert "outside the file" in r.stderr.decode(), r.stderr.decode()
    assert helpers.sha256_file(image) == before
