// Format probing: which disk-image format a file holds, from its first
// kProbeHeadBytes and its last kProbeTailBytes, as an entry of the format
// registry (image/format.h). Every format the registry knows is recognised
// here, including those qcowfs only refuses, so a container is never served
// (and written) as if it were a raw disk. The facts follow QEMU's block/*.c
// probe functions; raw is the default.
//
// open_image() (image/open.cc) is the one place that turns a probed or named
// format into a driver or a refusal (foreign_format_error()).
// Thread-safety: detect_format() and the table are pure; probe_format() reads
// through the HostFile, whose rules apply.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "image/format.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// QEMU probes the first 2 KiB (BLOCK_PROBE_BUF_SIZE); a VHD footer and a DMG
// trailer sit in the last 512 bytes.
inline constexpr size_t kProbeHeadBytes = 2048;
inline constexpr size_t kProbeTailBytes = 512;

// The format a file holds. head: its first bytes (up to kProbeHeadBytes,
// fewer for a short file); tail: its last kProbeTailBytes, or empty when the
// file is shorter than that. Never fails: unknown bytes are raw.
const FormatInfo& detect_format(std::span<const std::byte> head, std::span<const std::byte> tail);

// Reads the head and tail of file and detects its format.
Task<Result<const FormatInfo*>> probe_format_info(io::HostFile& file);

// The refusal of a recognised format qcowfs has no driver for. path is the
// image; `backing_of` names the overlay when the image is its backing file;
// `named` says the format came from format= / backing_fmt= rather than the
// file's bytes. errno EMEDIUMTYPE ("wrong medium type").
Status foreign_format_error(const std::string& path, const FormatInfo& format, bool named,
                            std::string_view backing_of = {});

// The refusal of format=NAME naming a format qcowfs does not read when the
// file's bytes show another one (`probed`): names what the bytes look like and,
// when qcowfs reads that, suggests it. errno EMEDIUMTYPE.
Status named_format_mismatch(const std::string& path, const FormatInfo& named, const FormatInfo& probed);

}  // namespace qcowfs::image
