// AlignedBuffer::for_large_io(): huge-page-advised mappings for megabyte buffers.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "io/buffer.h"

namespace qcowfs::io {
namespace {

// The /proc/self/smaps block of the mapping that starts at p, if any.
std::optional<std::string> smaps_entry(const void* p) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  std::ostringstream want;
  want << std::hex << reinterpret_cast<uintptr_t>(p) << "-";
  std::optional<std::string> entry;
  while (std::getline(in, line)) {
    const bool header = line.find('-') != std::string::npos && line.find(' ') > line.find('-') &&
                        line.rfind("VmFlags", 0) != 0 && std::isxdigit(static_cast<unsigned char>(line[0]));
    if (header) {
      if (entry) return entry;
      if (line.rfind(want.str(), 0) == 0) entry = line + "\n";
    } else if (entry) {
      *entry += line + "\n";
    }
  }
  return entry;
}

// The number after `name` in an smaps block (e.g. "Size:" -> kB), or -1.
long smaps_field(const std::string& entry, const std::string& name) {
  size_t at = entry.find("\n" + name);
  if (at == std::string::npos) return -1;
  return std::strtol(entry.c_str() + at + 1 + name.size(), nullptr, 10);
}

bool thp_allowed_for_madvise() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(in, s);
  return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
}

TEST(AlignedBuffer, SmallLargeIoBufferIsAnOrdinaryAlignedBuffer) {
  AlignedBuffer b = AlignedBuffer::for_large_io(64 * 1024, 8192);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(b.size(), 64u * 1024);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 8192, 0u);
  std::memset(b.data(), 0xab, b.size());
}

TEST(AlignedBuffer, LargeIoBufferIsAHugePageAlignedAdvisedMapping) {
  const size_t size = kLargeIoBytes + 8192;  // a FUSE request buffer
  AlignedBuffer b = AlignedBuffer::for_large_io(size);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(b.size(), size);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kHugePageSize, 0u);
  std::memset(b.data(), 0x5a, b.size());  // all of it writable
  EXPECT_EQ(b.data()[size - 1], std::byte{0x5a});

  auto entry = smaps_entry(b.data());
  ASSERT_TRUE(entry) << "no mapping starts at the buffer";
  EXPECT_EQ(smaps_field(*entry, "Size:"), 2048) << *entry;
  if (thp_allowed_for_madvise()) {
    EXPECT_EQ(smaps_field(*entry, "THPeligible:"), 1) << *entry;
    EXPECT_NE(entry->find(" hg"), std::string::npos) << "no MADV_HUGEPAGE flag\n" << *entry;
  }
}

TEST(AlignedBuffer, LargeIoBufferIsUnmappedWhenDropped) {
  const void* where = nullptr;
  {
    AlignedBuffer b = AlignedBuffer::for_large_io(3 * kLargeIoBytes);
    where = b.data();
    AlignedBuffer moved = std::move(b);
    EXPECT_EQ(moved.data(), where);
    EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): checking the moved-from state
    ASSERT_TRUE(smaps_entry(where));
  }
  EXPECT_FALSE(smaps_entry(where)) << "the mapping outlived its buffer";
}

}  // namespace
}  // namespace qcowfs::io
