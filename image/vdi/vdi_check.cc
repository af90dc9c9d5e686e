// check_vdi(): the block map walk of QEMU 7.2's vdi_co_check().
#include "image/vdi/vdi_check.h"

#include <algorithm>
#include <vector>

#include "image/endian.h"
#include "image/extent/host_read.h"
#include "image/vdi/format.h"
#include "image/vdi/header.h"

namespace qcowfs::image {
namespace {

using vdi::Header;

// Block map entries read at a time.
constexpr uint64_t kChunkEntries = 64 * 1024;
// Messages kept in the report; a hostile block map (blocks_in_image far past
// the end of the file reads as entries 0) could otherwise print hundreds of
// millions of lines, one per entry, as QEMU does.
constexpr size_t kMaxMessages = 10000;

class BlockMapCheck {
 public:
  explicit BlockMapCheck(const Header& h) : h_(h), used_(h.blocks_in_image) {}

  // One entry of block `block`, as vdi_co_check() judges it.
  void entry(uint32_t block, uint32_t e) {
    if (!vdi::is_allocated(e)) return;
    if (e >= h_.blocks_in_image) {
      error(fmt::format("ERROR: block index {} too large, is {}", block, e));
      return;
    }
    ++counted_;
    if (!used_[e]) {
      used_[e] = true;
      return;
    }
    // QEMU prints the entry twice (its bmap[entry] holds the entry itself).
    error(fmt::format("ERROR: block index {} also used by {}", e, e));
  }

  CheckReport finish() {
    if (counted_ != h_.blocks_allocated)
      error(fmt::format("ERROR: allocated blocks mismatch, is {}, should be {}", counted_, h_.blocks_allocated));
    if (dropped_ > 0) r_.messages.push_back(fmt::format("({} more such errors not shown)", dropped_));
    return std::move(r_);
  }

 private:
  void error(std::string message) {
    ++r_.corruptions;
    if (r_.messages.size() < kMaxMessages) r_.messages.push_back(std::move(message));
    else ++dropped_;
  }

  const Header& h_;
  std::vector<bool> used_;  // data block index -> named by an entry walked so far
  uint64_t counted_ = 0;
  uint64_t dropped_ = 0;
  CheckReport r_;
};

}  // namespace

Task<Result<CheckReport>> check_vdi(io::HostFile& file, std::string path, CheckOptions opts) {
  auto h = co_await vdi::read_header(file, path);
  if (!h) co_return h.status();
  if (opts.repair != RepairMode::none) co_return check_not_supported();
  BlockMapCheck check(*h);
  const uint64_t total = uint64_t{h->blocks_in_image} * sizeof(uint32_t);
  std::vector<std::byte> raw;
  for (uint64_t first = 0; first < h->blocks_in_image; first += kChunkEntries) {
    const uint64_t n = std::min<uint64_t>(kChunkEntries, h->blocks_in_image - first);
    const uint64_t off = h->offset_bmap + first * sizeof(uint32_t);
    raw.assign(static_cast<size_t>(n * sizeof(uint32_t)), std::byte{0});
    if (off < file.size()) {  // past the end, QEMU reads zeros
      auto st = co_await read_padded(file, off, raw);
      if (!st) co_return st.with_context(path + ": reading the VDI block map");
    }
    for (uint64_t i = 0; i < n; ++i)
      check.entry(static_cast<uint32_t>(first + i), load_le32(raw.data() + i * sizeof(uint32_t)));
    if (opts.progress) opts.progress((first + n) * sizeof(uint32_t), total);
  }
  co_return check.finish();
}

}  // namespace qcowfs::image
