"""Hostile LUKS headers for the corpus (tests/qcowfs_testlib/hostile.py loads cases()):
raw LUKS1 images made by qemu-img, and a LUKS-encrypted qcow2 whose LUKS area
is moved onto its metadata or past its end. Every case is refused while the
header is parsed, before any passphrase is asked for or any key derived (the
mounts and opens of the corpus give no key), with a message naming the
field. Offsets follow the LUKS1 on-disk format (big-endian phdr of 592
bytes, eight 48-byte key slots from byte 208) and qcow2's full disk
encryption header extension (0x0537be77)."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

from qcowfs_testlib import qcow2_meta as ed

KiB, MiB = 1 << 10, 1 << 20
SLOTS_AT, SLOT_BYTES = 208, 48


# qemu-img spends seconds on each LUKS image (its PBKDF2 benchmark runs
# whatever iter-time says), so each kind is made once per corpus build and
# copied into every case that starts from it.
_made: dict[str, bytes] = {}


def made_once(kind: str, create) -> bytes:
    """The bytes of the image create() makes, made on the first call for kind.
    create(path) runs qemu-img; its PBKDF2 benchmark fails now and then with
    SHA-NI hashes, so it is tried up to 8 times."""
    if kind not in _made:
        with tempfile.TemporaryDirectory(prefix="hostile_luks_") as tmp:
            img = Path(tmp) / "img"
            for attempt in range(8):
                try:
                    create(img)
                    break
                except RuntimeError:
                    if attempt == 7:
                        raise
            _made[kind] = img.read_bytes()
    return _made[kind]


def base(h, d: Path) -> Path:
    """4 MiB of payload, AES-256-XTS, one active key slot. sha512 for PBKDF2:
    qemu-img's PBKDF2 benchmark fails now and then with SHA-NI hashes."""
    img = d / "img.luks"
    img.write_bytes(made_once("luks", lambda p: h.run(
        "qemu-img", "create", "-q", "--object", "secret,id=s0,data=hostile-pass", "-f", "luks", "-o",
        "key-secret=s0,iter-time=10,hash-alg=sha512", p, "4M")))
    return img


def put(img: Path, off: int, data: bytes) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(data)


def patched(h, *edits):
    """edits: (offset, bytes) pairs; the bytes may be a function of the image."""
    def make(d: Path):
        img = base(h, d)
        for off, data in edits:
            put(img, off, data(img) if callable(data) else data)
        return h.Built(img, [img], extra={"format": "luks"})
    return make


def be32(v: int) -> bytes:
    return struct.pack(">I", v)


def slot(i: int, field: int) -> int:
    return SLOTS_AT + i * SLOT_BYTES + field


def truncated(h, size: int):
    def make(d: Path):
        img = base(h, d)
        with open(img, "r+b") as f:
            f.truncate(size)
        return h.Built(img, [img], extra={"format": "luks"})
    return make


def qcow2_luks_area(h, where):
    """A LUKS-encrypted qcow2 whose encryption header extension is rewritten
    to (offset, length) = where(img)."""
    def make(d: Path):
        img = d / "img.qcow2"
        img.write_bytes(made_once("qcow2-luks", lambda p: h.run(
            "qemu-img", "create", "-q", "--object", "secret,id=s0,data=hostile-pass", "-f", "qcow2", "-o",
            "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,encrypt.hash-alg=sha512", p, "16M")))
        data = img.read_bytes()[:64 * KiB]
        pos = data.find(bytes.fromhex("0537be77"))
        assert pos > 0, "no encryption header extension"
        off, length = where(img)
        put(img, pos + 8, struct.pack(">QQ", off, length))
        return h.Built(img, [img])
    return make


def cases(h) -> dict:
    return {
        "luks_truncated_header": h.Case(truncated(h, 100), h.Refused("truncated"),
                                        "a LUKS magic and 94 bytes more"),
        "luks_zero_stripes": h.Case(patched(h, (slot(0, 44), be32(0))), h.Refused("stripes"),
                                    "the active key slot has 0 anti-forensic stripes"),
        "luks_huge_stripes": h.Case(patched(h, (slot(0, 44), be32(0xFFFFFFFF))), h.Refused("stripes"),
                                    "2^32-1 stripes: a 128 GiB key material allocation bait"),
        "luks_key_material_past_the_file": h.Case(patched(h, (slot(0, 40), be32(0x10000000))),
                                                  h.Refused("past the end"),
                                                  "key material at sector 2^28 of a 6 MiB file"),
        "luks_key_material_on_the_header": h.Case(patched(h, (slot(0, 40), be32(0))), h.Refused("header"),
                                                  "key material at sector 0, over the phdr"),
        "luks_overlapping_key_slots": h.Case(patched(h, (slot(1, 0), be32(0x00AC71F3)),
                                                     (slot(1, 40), slot0_offset)),
                                             h.Refused("overlap"), "slot 1 made active on slot 0's material"),
        "luks_bad_slot_state": h.Case(patched(h, (slot(3, 0), be32(0x12345678))), h.Refused("neither enabled"),
                                      "a key slot neither enabled nor disabled"),
        "luks_unknown_cipher": h.Case(patched(h, (8, b"blowfish\0")), h.Refused("cipher"),
                                      "cipher name blowfish"),
        "luks_unterminated_cipher_mode": h.Case(patched(h, (40, b"x" * 32)), h.Refused("NUL|terminated"),
                                                "32 bytes of cipher mode without a NUL"),
        "luks_huge_key_bytes": h.Case(patched(h, (108, be32(100000))), h.Refused("key of 100000 bytes"),
                                      "a 100000-byte volume key"),
        "luks_huge_digest_iterations": h.Case(patched(h, (164, be32(0xFFFFFFFF))), h.Refused("iterations"),
                                              "2^32-1 master key digest iterations: hours of PBKDF2"),
        "luks_version_3": h.Case(patched(h, (6, struct.pack(">H", 3))), h.Refused("version 3"),
                                 "LUKS version 3"),
        "luks_qcow2_area_on_the_l1_table": h.Case(
            qcow2_luks_area(h, lambda img: (ed.get_field(img, "l1_table_offset"), 64 * KiB)),
            h.Refused("LUKS area"), "the qcow2 LUKS area moved onto the L1 table"),
        "luks_qcow2_area_past_the_end": h.Case(
            qcow2_luks_area(h, lambda img: (1 << 40, 2 * MiB)), h.Refused("LUKS area"),
            "the qcow2 LUKS area at 1 TiB of a 2 MiB file"),
        "luks_qcow2_area_unaligned": h.Case(
            qcow2_luks_area(h, lambda img: (64 * KiB + 512, 2 * MiB)), h.Refused("LUKS area"),
            "the qcow2 LUKS area not on a cluster boundary"),
    }


def slot0_offset(img: Path) -> bytes:
    """Slot 0's key material offset, as stored."""
    with open(img, "rb") as f:
        f.seek(slot(0, 40))
        return f.read(4)
