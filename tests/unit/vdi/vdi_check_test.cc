// check_vdi() (QEMU 7.2's vdi_co_check) over synthetic images in memory: a
// clean block map, entries out of range, a data block named twice, a
// blocks_allocated mismatch, block map entries past the end of the file
// (zeros, as QEMU reads them), and no repair (QEMU's -ENOTSUP).
#include <gtest/gtest.h>

#include <cstring>

#include "image/endian.h"
#include "image/vdi/format.h"
#include "image/vdi/vdi_check.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"

namespace qcowfs::image {
namespace {

using Bytes = std::vector<std::byte>;
constexpr uint32_t kBmap = 512;

// A dynamic VDI header of `blocks` blocks with the block map `map` at 512
// (the file ends after the map; the check reads no data).
Bytes image(uint32_t blocks, std::vector<uint32_t> map, uint32_t allocated) {
  Bytes b(kBmap + map.size() * 4);
  store_le32(b.data() + 64, vdi::kSignature);
  store_le32(b.data() + 68, vdi::kVersion1_1);
  store_le32(b.data() + 76, vdi::kTypeDynamic);
  store_le32(b.data() + 340, kBmap);
  store_le32(b.data() + 344, 1 << 20);
  store_le32(b.data() + 360, vdi::kSectorSize);
  store_le64(b.data() + 368, uint64_t{blocks} * vdi::kBlockSize);
  store_le32(b.data() + 376, vdi::kBlockSize);
  store_le32(b.data() + 384, blocks);
  store_le32(b.data() + 388, allocated);
  for (size_t i = 0; i < map.size(); ++i) store_le32(b.data() + kBmap + 4 * i, map[i]);
  return b;
}

class VdiCheck : public ::testing::Test {
 protected:
  VdiCheck() : engine_(std::move(*io::make_engine(io::EngineKind::threads))) {}

  Result<CheckReport> check(const Bytes& b, RepairMode repair = RepairMode::none) {
    io::MemFileOptions o;
    o.writable = repair != RepairMode::none;
    o.path = "/tmp/t.vdi";
    io::MemFile file(o, b);
    CheckOptions opts;
    opts.repair = repair;
    return io::run_sync(*engine_, check_vdi(file, o.path, opts));
  }

  std::unique_ptr<io::Engine> engine_;
};

TEST_F(VdiCheck, CleanMapHasNoFindings) {
  auto r = check(image(4, {0, vdi::kUnallocated, 1, vdi::kDiscarded}, 2));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->corruptions, 0u);
  EXPECT_TRUE(r->messages.empty());
}

TEST_F(VdiCheck, OutOfRangeDuplicateAndMismatchAreCorruptions) {
  auto r = check(image(4, {0, 7, 0, 2}, 2));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->corruptions, 3u);
  EXPECT_EQ(r->leaks, 0u);
  EXPECT_EQ(r->messages, (std::vector<std::string>{"ERROR: block index 1 too large, is 7",
                                                   "ERROR: block index 0 also used by 0",
                                                   "ERROR: allocated blocks mismatch, is 3, should be 2"}));
}

TEST_F(VdiCheck, MismatchAlone) {
  auto r = check(image(4, {0, 1, 2, vdi::kUnallocated}, 2));
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->corruptions, 1u);
  EXPECT_EQ(r->messages, (std::vector<std::string>{"ERROR: allocated blocks mismatch, is 3, should be 2"}));
}

TEST_F(VdiCheck, EntriesPastTheEndOfTheFileReadAsZeros) {
  // Two entries in the file, the other two past its end: entry 0 twice more.
  auto r = check(image(4, {0, vdi::kUnallocated}, 1));
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->corruptions, 3u);  // two duplicates, and 3 counted against 1
}

TEST_F(VdiCheck, RepairIsNotSupportedAsInQemu) {
  for (RepairMode m : {RepairMode::leaks, RepairMode::all}) {
    auto r = check(image(4, {0, 1, 2, vdi::kUnallocated}, 2), m);
    ASSERT_FALSE(r.is_ok());
    EXPECT_TRUE(is_check_not_supported(r.status())) << r.status().to_string();
  }
  // A header QEMU cannot open fails the open, not the check.
  Bytes bad = image(4, {}, 0);
  store_le32(bad.data() + 376, 2 << 20);
  auto r = check(bad, RepairMode::all);
  ASSERT_FALSE(r.is_ok());
  EXPECT_FALSE(is_check_not_supported(r.status()));
}

}  // namespace
}  // namespace qcowfs::image
