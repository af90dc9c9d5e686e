"""Low-level editing of VHDX metadata for tests (hostile corpus, integration).

Reads and patches the structures of images made by qemu-img: the two headers
(64 KiB, 128 KiB; CRC-32C over 4 KiB), the region table (192 KiB; CRC-32C over
64 KiB), metadata items, BAT entries, and writes log entries (CRC-32C over the
whole entry). Layouts follow Microsoft's [MS-VHDX] and QEMU's block/vhdx.h;
everything is little-endian. Only test code uses this; not thread-safe.
"""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20

HEADER_OFFSETS = (64 * KiB, 128 * KiB)
HEADER_SIZE = 4 * KiB
REGION_TABLE_OFFSETS = (192 * KiB, 256 * KiB)
REGION_TABLE_SIZE = 64 * KiB

# GUIDs as they are stored on disk (Microsoft's mixed-endian layout).
BAT_GUID = uuid.UUID("2dc27766-f623-4200-9d64-115e9bfd4a08").bytes_le
METADATA_GUID = uuid.UUID("8b7ca206-4790-4b9a-b8fe-575f050f886e").bytes_le
FILE_PARAMETERS_GUID = uuid.UUID("caa16737-fa36-4d43-b3b6-33f0aa44e76b").bytes_le
VIRTUAL_DISK_SIZE_GUID = uuid.UUID("2fa54224-cd1b-4876-b211-5dbed83bf4b8").bytes_le
PAGE83_GUID = uuid.UUID("beca12ab-b2e6-4523-93ef-c309e000c746").bytes_le
LOGICAL_SECTOR_GUID = uuid.UUID("8141bf1d-a96f-4709-ba47-f233a8faab5f").bytes_le
PHYSICAL_SECTOR_GUID = uuid.UUID("cda348c7-445d-4471-9cc9-e9885251c556").bytes_le
PARENT_LOCATOR_GUID = uuid.UUID("a8d35f2d-b30b-454d-abf7-d3d84834ab0c").bytes_le

# Header fields: name -> (offset in the header, struct format).
HEADER_FIELDS = {
    "signature": (0, "<I"), "checksum": (4, "<I"), "sequence_number": (8, "<Q"),
    "file_write_guid": (16, "16s"), "data_write_guid": (32, "16s"), "log_guid": (48, "16s"),
    "log_version": (64, "<H"), "version": (66, "<H"), "log_length": (68, "<I"), "log_offset": (72, "<Q"),
}

STATE_NOT_PRESENT, STATE_UNDEFINED, STATE_ZERO, STATE_UNMAPPED = 0, 1, 2, 3
STATE_FULLY_PRESENT, STATE_PARTIALLY_PRESENT = 6, 7


def _table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    t = _CRC_TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def read(path: str | os.PathLike, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        data = f.read(n)
    return data + bytes(n - len(data))


def write(path: str | os.PathLike, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def with_checksum(block: bytes, at: int = 4) -> bytes:
    """block with its CRC-32C (computed with the field zeroed) stored at `at`."""
    b = bytearray(block)
    b[at:at + 4] = bytes(4)
    b[at:at + 4] = struct.pack("<I", crc32c(bytes(b)))
    return bytes(b)


# --------------------------------------------------------------------------
# Headers


def header(path, index: int) -> dict:
    raw = read(path, HEADER_OFFSETS[index], HEADER_SIZE)
    return {name: struct.unpack_from(fmt, raw, off)[0] for name, (off, fmt) in HEADER_FIELDS.items()}


def current_header_index(path) -> int:
    """The header QEMU uses: the one with the larger sequence number (both valid)."""
    return 0 if header(path, 0)["sequence_number"] > header(path, 1)["sequence_number"] else 1


def set_header_fields(path, index: int, fix_checksum: bool = True, **fields) -> None:
    raw = bytearray(read(path, HEADER_OFFSETS[index], HEADER_SIZE))
    for name, value in fields.items():
        off, fmt = HEADER_FIELDS[name]
        struct.pack_into(fmt, raw, off, value)
    data = with_checksum(bytes(raw)) if fix_checksum else bytes(raw)
    write(path, HEADER_OFFSETS[index], data)


def corrupt_header_checksum(path, index: int) -> None:
    raw = bytearray(read(path, HEADER_OFFSETS[index], HEADER_SIZE))
    raw[4] ^= 0xFF
    write(path, HEADER_OFFSETS[index], bytes(raw))


# --------------------------------------------------------------------------
# Region table


def region_entries(path, table: int = 0) -> list[dict]:
    raw = read(path, REGION_TABLE_OFFSETS[table], REGION_TABLE_SIZE)
    count = struct.unpack_from("<I", raw, 8)[0]
    out = []
    for i in range(min(count, 2047)):
        guid, off, length, bits = struct.unpack_from("<16sQII", raw, 16 + 32 * i)
        out.append({"index": i, "guid": guid, "file_offset": off, "length": length, "data_bits": bits})
    return out


def region(path, guid: bytes) -> dict:
    return next(e for e in region_entries(path) if e["guid"] == guid)


def set_region_entry(path, guid: bytes, table: int = 0, **fields) -> None:
    base = REGION_TABLE_OFFSETS[table]
    raw = bytearray(read(path, base, REGION_TABLE_SIZE))
    e = next(e for e in region_entries(path, table) if e["guid"] == guid)
    e.update(fields)
    struct.pack_into("<16sQII", raw, 16 + 32 * e["index"], e["guid"], e["file_offset"], e["length"],
                     e["data_bits"])
    write(path, base, with_checksum(bytes(raw)))


def bat_offset(path) -> int:
    return region(path, BAT_GUID)["file_offset"]


def metadata_offset(path) -> int:
    return region(path, METADATA_GUID)["file_offset"]


# --------------------------------------------------------------------------
# Metadata


def metadata_items(path) -> list[dict]:
    base = metadata_offset(path)
    raw = read(path, base, 64 * KiB)
    count = struct.unpack_from("<H", raw, 10)[0]
    out = []
    for i in range(min(count, 2047)):
        guid, off, length, bits = struct.unpack_from("<16sIII", raw, 32 + 32 * i)
        out.append({"index": i, "guid": guid, "offset": off, "length": length, "data_bits": bits})
    return out


def metadata_item_offset(path, guid: bytes) -> int:
    """File offset of a metadata item's value."""
    item = next(i for i in metadata_items(path) if i["guid"] == guid)
    return metadata_offset(path) + item["offset"]


def set_metadata_u32(path, guid: bytes, value: int, at: int = 0) -> None:
    write(path, metadata_item_offset(path, guid) + at, struct.pack("<I", value & 0xFFFFFFFF))


def set_metadata_u64(path, guid: bytes, value: int) -> None:
    write(path, metadata_item_offset(path, guid), struct.pack("<Q", value & (2**64 - 1)))


def get_metadata_u32(path, guid: bytes, at: int = 0) -> int:
    return struct.unpack("<I", read(path, metadata_item_offset(path, guid) + at, 4))[0]


def get_metadata_u64(path, guid: bytes) -> int:
    return struct.unpack("<Q", read(path, metadata_item_offset(path, guid), 8))[0]


def block_size(path) -> int:
    return get_metadata_u32(path, FILE_PARAMETERS_GUID)


def set_metadata_entry(path, item_guid: bytes, **fields) -> None:
    """Rewrites one metadata table entry (its guid, offset, length or flags)."""
    base = metadata_offset(path)
    item = next(i for i in metadata_items(path) if i["guid"] == item_guid)
    item.update(fields)
    write(path, base + 32 + 32 * item["index"],
          struct.pack("<16sIII", item["guid"], item["offset"], item["length"], item["data_bits"]))


# --------------------------------------------------------------------------
# BAT


def chunk_ratio(path, logical_sector: int = 512) -> int:
    return (1 << 23) * logical_sector // block_size(path)


def bat_index(path, block: int, logical_sector: int = 512) -> int:
    """The BAT index of payload block `block` (sector bitmap entries interleaved)."""
    return block + block // chunk_ratio(path, logical_sector)


def get_bat(path, index: int) -> int:
    return struct.unpack("<Q", read(path, bat_offset(path) + 8 * index, 8))[0]


def set_bat(path, index: int, value: int) -> None:
    write(path, bat_offset(path) + 8 * index, struct.pack("<Q", value & (2**64 - 1)))


def bat_entry(state: int, file_offset: int) -> int:
    return (file_offset & ~(MiB - 1)) | state


# --------------------------------------------------------------------------
# Log


def log_entry(log_guid: bytes, sequence: int, writes: list[tuple[int, bytes]], flushed_file_offset: int,
              last_file_offset: int, tail: int = 0) -> bytes:
    """One log entry: header, data descriptors and data sectors for `writes`
    (file offset, 4096 bytes), CRC-32C over the whole entry."""
    count = len(writes)
    desc_sectors = (count + 2 + 127) // 128
    total = (desc_sectors + count) * 4096
    entry = bytearray(total)
    struct.pack_into("<4sIIIQII16sQQ", entry, 0, b"loge", 0, total, tail, sequence, count, 0, log_guid,
                     flushed_file_offset, last_file_offset)
    for i, (off, data) in enumerate(writes):
        assert len(data) == 4096 and off % 4096 == 0
        struct.pack_into("<4s4s8sQQ", entry, 64 + 32 * i, b"desc", data[4092:], data[:8], off, sequence)
        sector = (desc_sectors + i) * 4096
        struct.pack_into("<4sI", entry, sector, b"data", sequence >> 32)
        entry[sector + 8:sector + 4092] = data[8:4092]
        struct.pack_into("<I", entry, sector + 4092, sequence & 0xFFFFFFFF)
    return with_checksum(bytes(entry))


def write_pending_log(path, writes: list[tuple[int, bytes]], sequence: int = 1) -> bytes:
    """Leaves the image as a writer killed after its log write: a valid log
    entry for `writes` at the start of the log, and the current header naming
    its log GUID. Returns the log GUID."""
    guid = uuid.uuid4().bytes_le
    cur = current_header_index(path)
    h = header(path, cur)
    size = Path(path).stat().st_size
    write(path, h["log_offset"], log_entry(guid, sequence, writes, size, size))
    set_header_fields(path, cur, log_guid=guid)
    return guid
