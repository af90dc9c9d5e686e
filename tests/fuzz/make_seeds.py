"""Writes seed inputs for the libFuzzer targets from small images made by qemu-img.

  python3 make_seeds.py OUTDIR     ->  OUTDIR/{header,l2,image,probe}/... and OUTDIR/FMT/...
                                       for every format in FORMAT_IMAGES (fuzz_FMT),
                                       OUTDIR/luks_header/... (fuzz_luks_header)

Images are tiny (512 B - 16 KiB clusters, <= 1 MiB disks) so the fuzzer mutates
metadata rather than data. Runs in a few seconds; idempotent.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path


from qcowfs_testlib import qcow2_meta as ed

IMAGES = {
    # name: (create options, size, qemu-io commands)
    "plain512": ("cluster_size=512", "256K", ["write -P 1 0 4k", "write -P 2 100k 1k", "write -z 200k 4k"]),
    "zlib": ("cluster_size=4096", "256K", ["write -c -P 3 0 4k", "write -c -P 4 8k 4k", "write -P 5 64k 4k"]),
    "zstd": ("cluster_size=4096,compression_type=zstd", "256K", ["write -c -P 6 0 4k", "write -P 7 12k 4k"]),
    "v2": ("compat=0.10,cluster_size=1024", "256K", ["write -P 8 0 8k", "write -z 32k 1k"]),
    "extl2": ("extended_l2=on,cluster_size=16384", "1M", ["write -P 9 0 2k", "write -P 10 16k 16k",
                                                          "write -z 64k 1k"]),
    "refcount1": ("refcount_bits=1,cluster_size=512", "128K", ["write -P 11 0 2k"]),
}


def run(*args) -> None:
    subprocess.run([str(a) for a in args], check=True, stdout=subprocess.DEVNULL, timeout=120)


def make_image(tmp: Path, name: str) -> Path:
    opts, size, cmds = IMAGES[name]
    img = tmp / f"{name}.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, img, size)
    args = ["qemu-io", "-f", "qcow2"]
    for c in cmds:
        args += ["-c", c]
    run(*args, img)
    if name == "plain512":
        run("qemu-img", "snapshot", "-c", "snap1", img)
    return img


def l2_seed(img: Path) -> bytes:
    """cluster_bits, flags, file size, then the image's first L2 entries as records."""
    bits = ed.cluster_bits(img)
    flags = 1 if ed.extended_l2(img) else 0
    out = struct.pack("<BBQ", bits - 9, flags, img.stat().st_size)
    esz = ed.l2_entry_size(img)
    table = ed.l2_table_offset(img, 0)
    for i in range(16):
        entry = ed.read_u64(img, table + i * esz)
        bitmap = ed.read_u64(img, table + i * esz + 8) if esz == 16 else 0
        out += struct.pack("<QQII", entry, bitmap, i * 512, 4096)
    return out


# Seeds of the per-format targets (fuzz_FMT, tests/fuzz/fuzz_format.cc): small
# images of each variant qemu-img makes, with data, zeros and holes.
FORMAT_CMDS = ["write -P 1 0 4k", "write -P 2 300k 8k", "write -z 600k 64k", "write -P 3 1020k 4k"]
FORMAT_IMAGES = {
    "qed": [("", "1M"), ("cluster_size=4096", "1M")],
    "vdi": [("", "2M"), ("static=on", "2M")],
    "parallels": [("", "2M"), ("cluster_size=64k", "1M")],
    "vpc": [("", "2M"), ("subformat=fixed", "2M"), ("force_size=on", "2M")],
    "vhdx": [("block_size=1M", "2M"), ("subformat=fixed,block_size=1M", "2M"),
             ("block_size=1M,log_size=1M", "4M")],
    "vmdk": [("", "1M"), ("subformat=streamOptimized", "1M"), ("zeroed_grain=on", "1M"),
             ("subformat=monolithicFlat", "1M")],
}


def format_seeds(tmp: Path, out: Path) -> None:
    for fmt, variants in FORMAT_IMAGES.items():
        (out / fmt).mkdir(parents=True, exist_ok=True)
        for i, (opts, size) in enumerate(variants):
            img = tmp / f"seed-{fmt}-{i}"
            # streamOptimized images are written once, in order: convert into one.
            stream = "streamOptimized" in opts
            target = tmp / f"seed-{fmt}-{i}.raw" if stream else img
            run("qemu-img", "create", "-q", "-f", "raw" if stream else fmt,
                *(["-o", opts] if opts and not stream else []), target, size)
            args = ["qemu-io", "-f", "raw" if stream else fmt]
            for c in FORMAT_CMDS:
                args += ["-c", c]
            run(*args, target)
            if stream:
                run("qemu-img", "convert", "-O", fmt, "-o", opts, target, img)
            if "monolithicFlat" in opts:  # the descriptor alone: its extent file is not in memory
                continue
            shutil.copy(img, out / fmt / f"{fmt}-{i}")
            if fmt == "vhdx" and i == 0:  # a log that needs replay: fuzz_vhdx's writable open replays it
                vhdx_pending_log_seed(img, out / fmt / "vhdx-pending-log")


def vhdx_pending_log_seed(img: Path, out: Path) -> None:
    from qcowfs_testlib import vhdx_edit

    shutil.copy(img, out)
    block0 = vhdx_edit.get_bat(out, 0) & ~0xFFFFF
    vhdx_edit.write_pending_log(out, [(block0 + 8192, bytes([0x77]) * 4096)])


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    for sub in ("header", "l2", "image", "probe"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qcowfs-seeds-") as t:
        tmp = Path(t)
        for name in IMAGES:
            img = make_image(tmp, name)
            shutil.copy(img, out / "image" / name)
            (out / "header" / name).write_bytes(img.read_bytes()[: 1 << ed.cluster_bits(img)] +
                                                snapshot_table(img))
            (out / "l2" / name).write_bytes(l2_seed(img))
        probe_seeds(tmp, out / "probe")
        format_seeds(tmp, out)
        vmdk_descriptor_seeds(tmp, out / "vmdk_descriptor")
        luks_header_seeds(tmp, out / "luks_header")
        luks1_seeds(tmp, out / "luks1")
        bitmap_seeds(tmp, out / "bitmap")
    fuse_message_seeds(out / "fuse_message")
    return 0


# Seeds of fuzz_fuse_message: the READ, WRITE and INTERRUPT messages the kernel
# sends (fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid,
# total_extlen, padding), and a LOOKUP, which is left to libfuse.
def fuse_message_seeds(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def message(opcode: int, args: bytes) -> bytes:
        return struct.pack("<IIQQIIIHH", 40 + len(args), opcode, 42, 1, 0, 0, 0, 0, 0) + args

    read_in = struct.pack("<QQIIQII", 0, 8192, 4096, 0, 0, 0, 0)       # fh, offset, size, ...
    write_in = struct.pack("<QQIIQII", 0, 4096, 512, 0, 0, 0, 0) + bytes(range(256)) * 2
    (out / "read").write_bytes(message(15, read_in))
    (out / "write").write_bytes(message(16, write_in))
    (out / "interrupt").write_bytes(message(36, struct.pack("<Q", 41)))
    (out / "lookup").write_bytes(message(1, b"disk.raw\0"))


# Seeds of fuzz_bitmap: u8 cluster_bits, u32 nb_bitmaps, u32 directory length,
# u64 disk size (little-endian), then the bitmap directory and the first
# bitmap's table, as qemu-img bitmap writes them.
def bitmap_seeds(tmp: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    img = tmp / "bitmaps.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img), "16M"], check=True)
    for args in (["b0"], ["-g", "512k", "b1"], ["--disable", "d"]):
        subprocess.run(["qemu-img", "bitmap", "--add", "-f", "qcow2", *args[:-1], str(img), args[-1]], check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write 1M 64k", str(img)], check=True, stdout=subprocess.DEVNULL)
    ext = dict(ed.read_extensions(img))[0x23852875]
    nb, _, dir_size, dir_offset = struct.unpack(">IIQQ", ext[:24])
    data = img.read_bytes()
    directory = data[dir_offset:dir_offset + dir_size]
    table = struct.unpack(">Q", directory[:8])[0]
    seed = struct.pack("<BIIQ", ed.cluster_bits(img), nb, dir_size, 16 << 20) + directory + data[table:table + 64]
    (out / "qemu-three").write_bytes(seed)


# Formats fuzz_probe starts from: the first 4 KiB (and the last 512 bytes) of
# each, as qemu-img makes them.
PROBE_FORMATS = {
    "vmdk": ["-f", "vmdk"], "vmdk_stream": ["-f", "vmdk", "-o", "subformat=streamOptimized"],
    "vmdk_flat": ["-f", "vmdk", "-o", "subformat=monolithicFlat"], "vhdx": ["-f", "vhdx"],
    "vpc": ["-f", "vpc"], "vpc_fixed": ["-f", "vpc", "-o", "subformat=fixed"], "vdi": ["-f", "vdi"],
    "qed": ["-f", "qed"], "parallels": ["-f", "parallels"], "qcow2": ["-f", "qcow2"],
}


def probe_seeds(tmp: Path, out: Path) -> None:
    for name, args in PROBE_FORMATS.items():
        img = tmp / f"probe-{name}"
        run("qemu-img", "create", "-q", *args, img, "1M")
        data = img.read_bytes()
        (out / name).write_bytes(data[:4096] + (data[-512:] if len(data) > 4096 else b""))


def snapshot_table(img: Path) -> bytes:
    """The snapshot table bytes (what fuzz_header parses after the first cluster)."""
    if ed.get_field(img, "nb_snapshots") == 0:
        return b""
    data = img.read_bytes()
    off = ed.get_field(img, "snapshots_offset")
    return data[off: off + 4096]


# Seeds of fuzz_vmdk_descriptor: the text descriptors qemu-img writes (flat and
# split kinds, a delta's parent hint) and one of every extent line kind.
def vmdk_descriptor_seeds(tmp: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("monolithicFlat", "twoGbMaxExtentSparse", "twoGbMaxExtentFlat"):
        img = tmp / f"desc-{sub}.vmdk"
        run("qemu-img", "create", "-q", "-f", "vmdk", "-o", f"subformat={sub}", img, "1M")
        shutil.copy(img, out / sub)
    base, delta = tmp / "desc-base.vmdk", tmp / "desc-delta.vmdk"
    run("qemu-img", "create", "-q", "-f", "vmdk", base, "1M")
    run("qemu-img", "create", "-q", "-f", "vmdk", "-b", base.name, "-F", "vmdk", delta)
    text = delta.read_bytes()[512:512 + 20 * 512]
    (out / "delta").write_bytes(text.split(b"\0", 1)[0])
    (out / "every_kind").write_text(
        '# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType="vmfs"\n'
        'RW 100 FLAT "a" 0\nRW 100 ZERO\nRDONLY 50 SPARSE "b"\nRW 7 VMFS "c"\nRW 8 VMFSSPARSE "d"\n'
        'NOACCESS 9 FLAT "e" 3\nRW 1 SESPARSE "f"\nparentFileNameHint="p.vmdk"\n')


# Seeds of fuzz_luks_header: whole LUKS header areas (header and key material, as
# the LUKS area of a qcow2 image holds them), the smallest each tool makes: LUKS1
# by qemu-img with a 16-byte key (516 KiB), LUKS2 by cryptsetup with 16 KiB
# metadata and a 256 KiB key slot area.
def luks_header_seeds(tmp: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    l1 = tmp / "seed.luks"
    run("qemu-img", "create", "-q", "--object", "secret,id=s0,data=pw", "-f", "luks", "-o",
        "key-secret=s0,iter-time=10,hash-alg=sha512,cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256",
        l1, "64K")
    data = l1.read_bytes()
    payload_sectors = struct.unpack(">I", data[104:108])[0]
    (out / "luks1").write_bytes(data[: payload_sectors * 512])
    if shutil.which("cryptsetup") is None:
        return
    l2, key = tmp / "seed2.luks", tmp / "seed2.key"
    key.write_bytes(b"pw")
    with open(l2, "wb") as f:
        f.truncate(2 << 20)
    run("cryptsetup", "luksFormat", "--type", "luks2", "--batch-mode", "--pbkdf", "pbkdf2", "--iter-time", "10",
        "--key-size", "256", "--luks2-metadata-size", "16k", "--luks2-keyslots-size", "256k", "--key-file", key, l2)
    (out / "luks2").write_bytes(l2.read_bytes()[: 2 * (16 << 10) + (256 << 10)])

# Seeds of fuzz_luks1: LUKS1 images by cryptsetup with the passphrase "x" and
# 1000 PBKDF2 iterations (so the target unlocks them), cut after slot 0's key
# material (sector 8 on, key bytes * 4000 stripes).
LUKS1_SEEDS = {"aes_cbc_plain64_sha1": ["-c", "aes-cbc-plain64", "-s", "128", "-h", "sha1"],
               "aes_xts_plain64_sha256": ["-c", "aes-xts-plain64", "-s", "256", "-h", "sha256"]}


def luks1_seeds(tmp: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    key = tmp / "luks1-key"
    key.write_bytes(b"x")
    for name, args in LUKS1_SEEDS.items():
        img = tmp / f"luks1-{name}"
        with open(img, "wb") as f:
            f.truncate(3 << 20)
        run("cryptsetup", "luksFormat", "-q", "--type", "luks1", "--pbkdf-force-iterations", "1000",
            *args, "--key-file", key, img)
        key_bytes = int(args[args.index("-s") + 1]) // 8
        end = 8 * 512 + (key_bytes * 4000 + 511) // 512 * 512
        (out / name).write_bytes(img.read_bytes()[:end])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
