// The VDI writer's own rules (image/vdi/writer.h, vdi.cc); the write path it
// shares with the other table formats is tested in image_extent_write_test.cc.
// Block maps a new block could corrupt are refused for writing; a discard of
// whole blocks of a dynamic image marks them discarded and moves the last
// data blocks into their place (blocks_allocated goes down, the file is cut),
// with writes into a moving block held until it moved and reads in flight
// waited for; every crash point of such discards leaves an image qemu-img
// check finds clean with every flushed byte intact; static images zero
// discarded blocks in place.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "unit/image/forwarding_file.h"
#include "image/endian.h"
#include "image/vdi/format.h"
#include "image/vdi/vdi.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/sync.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;
using qcow2::testing::read_file;
using qcow2::testing::shell;
using qcow2::testing::write_file;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kDisk = 8 * kMiB + 3 * 512;  // blocks 0-8, the last one used in part
constexpr uint64_t kBlocks = 9;

Bytes pattern(size_t n, uint8_t v) { return Bytes(n, std::byte{v}); }

bool all_are(std::span<const std::byte> s, uint8_t v) {
  return std::all_of(s.begin(), s.end(), [v](std::byte b) { return b == std::byte{v}; });
}

// The header fields and block map entries of a VDI image, as on disk.
struct Layout {
  uint32_t offset_data = 0;
  uint32_t blocks_allocated = 0;
  std::vector<uint32_t> entries;
};

Layout layout_of(const Bytes& img) {
  Layout l;
  const uint32_t bmap = load_le32(img.data() + offsetof(vdi::HeaderLayout, offset_bmap));
  l.offset_data = load_le32(img.data() + offsetof(vdi::HeaderLayout, offset_data));
  l.blocks_allocated = load_le32(img.data() + offsetof(vdi::HeaderLayout, blocks_allocated));
  for (uint64_t b = 0; b < kBlocks; ++b) l.entries.push_back(load_le32(img.data() + bmap + 4 * b));
  return l;
}

// Host I/O of one kind into bytes [lo, hi) waits, once armed, each until the
// test releases it: a lock-free read or write kept in flight between its map
// lookup and its host I/O.
class GatedFile final : public qcowfs::testing::ForwardingFile {
 public:
  enum class Kind { read, write };
  explicit GatedFile(io::HostFile& f) : ForwardingFile(f) {}
  void arm(Kind kind, uint64_t lo, uint64_t hi) {
    kind_ = kind;
    lo_ = lo;
    hi_ = hi;
    armed_ = true;
  }
  void disarm() { armed_ = false; }
  size_t waiting() const { return held_.size(); }
  void release_first() {
    held_.front()->set();
    held_.pop_front();
  }
  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override {
    co_await gate(Kind::read, off, buf.size());
    co_return co_await inner().read(off, buf);
  }
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override {
    co_await gate(Kind::write, off, buf.size());
    co_return co_await inner().write(off, buf);
  }

 private:
  Task<void> gate(Kind kind, uint64_t off, uint64_t len) {
    if (!armed_ || kind != kind_ || off >= hi_ || lo_ >= off + len) co_return;
    auto ev = std::make_shared<io::AsyncEvent>();
    held_.push_back(ev);
    co_await ev->wait();
  }

  bool armed_ = false;
  Kind kind_ = Kind::read;
  uint64_t lo_ = 0, hi_ = 0;
  std::deque<std::shared_ptr<io::AsyncEvent>> held_;  // touched only on the test's engine thread
};

class VdiWrite : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path("/var/tmp") / fmt::format("qcowfs_vdi_write_test_{}", ::getpid());
    fs::create_directories(dir_);
    engine_ = std::move(*io::make_engine(io::EngineKind::threads));
  }
  void TearDown() override { fs::remove_all(dir_); }

  template <typename T>
  T run(Task<T> t) {
    return io::run_sync(*engine_, std::move(t));
  }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  void sh(const std::string& cmd) {
    std::string out;
    ASSERT_EQ(shell("cd " + dir_.string() + " && " + cmd, &out), 0) << cmd << "\n" << out;
  }

  // i.vdi: kDisk bytes, block b holding 0x10 + b, in data block b (qemu-io
  // allocates in the order it writes); `opts` for qemu-img create.
  Bytes make_blocks(const std::string& opts = "") {
    std::string writes;
    for (uint64_t b = 0; b < kBlocks; ++b)
      writes += fmt::format(" -c 'write -P {} {} {}'", 0x10 + b, b * kMiB, std::min(kMiB, kDisk - b * kMiB));
    sh(fmt::format("qemu-img create -q -f vdi {} i.vdi {} && qemu-io -f vdi{} i.vdi >/dev/null",
                   opts.empty() ? "" : "-o " + opts, kDisk, writes));
    return read_file(at("i.vdi"));
  }

  std::unique_ptr<BlockDriver> open(std::unique_ptr<io::HostFile> file) {
    ImageOptions o;
    o.file.writable = true;
    auto d = run(open_vdi(std::move(file), at("i.vdi"), o));
    EXPECT_TRUE(d) << d.status().to_string();
    return d ? std::move(*d) : nullptr;
  }
  // A writable driver over a MemFile holding img (tracking unflushed writes).
  std::unique_ptr<BlockDriver> open(const Bytes& img, io::MemFile** file) {
    io::MemFileOptions mo;
    mo.track_unflushed = true;
    auto mem = std::make_unique<io::MemFile>(mo, img);
    *file = mem.get();
    return open(std::move(mem));
  }

  Bytes read(BlockDriver& d, uint64_t off, uint64_t len) {
    Bytes b(len);
    EXPECT_TRUE(run(d.read(off, b)));
    return b;
  }
  Bytes view(BlockDriver& d) { return read(d, 0, kDisk); }

  // qemu-img check of img (clean: exit status 0, no ERROR line) and what
  // qemu-img convert reads of it.
  Bytes qemu_raw(const Bytes& img, const std::string& where) {
    write_file(at("c.vdi"), img);
    std::string out;
    EXPECT_EQ(shell(fmt::format("qemu-img check -f vdi {}", at("c.vdi")), &out), 0) << where << ":\n" << out;
    EXPECT_EQ(out.find("ERROR"), std::string::npos) << where << ":\n" << out;
    EXPECT_EQ(shell(fmt::format("qemu-img convert -f vdi -O raw {0} {0}.raw", at("c.vdi")), &out), 0) << out;
    return read_file(at("c.vdi.raw"));
  }
  // qemu_raw(img) once per distinct image among the last few: qemu-img's
  // verdict and raw depend on the image's bytes alone, and a cut's crash
  // images often equal its content, or an image of a neighbouring cut (171
  // images of EveryCrashPointOfDiscardsWithMovesLeavesACleanImage, 35 of them
  // distinct, each met again within the next four distinct ones). An image
  // equal byte for byte to one checked gets that one's raw; its failures were
  // reported then.
  Bytes qemu_raw_of_distinct(const Bytes& img, const std::string& where) {
    for (auto it = checked_.begin(); it != checked_.end(); ++it) {
      if (it->image == img) {
        Checked seen = std::move(*it);
        checked_.erase(it);
        checked_.push_back(std::move(seen));
        return checked_.back().raw;
      }
    }
    Bytes raw = qemu_raw(img, where);
    if (checked_.size() == kCheckedKept) checked_.pop_front();
    checked_.push_back({img, raw});
    return raw;
  }
  // After close: QEMU checks the image clean and reads what the driver read.
  void expect_qemu_reads(const Bytes& img, const Bytes& ours, const std::string& where) {
    EXPECT_TRUE(qemu_raw(img, where) == ours) << where << ": QEMU reads otherwise";
  }

  fs::path dir_;
  std::unique_ptr<io::Engine> engine_;
  struct Checked {
    Bytes image, raw;
  };
  static constexpr size_t kCheckedKept = 4;
  std::deque<Checked> checked_;  // the last images qemu_raw_of_distinct checked, the latest last
};

// Block maps that would make a new block overwrite one in use are refused for
// writing (read-only opens still work).
TEST_F(VdiWrite, AllocationThatCouldOverwriteABlockIsRefused) {
  sh("qemu-img create -q -f vdi i.vdi 8M && qemu-io -f vdi -c 'write -P 1 0 4k' -c 'write -P 2 1M 4k' i.vdi");
  const Bytes good = read_file(at("i.vdi"));
  const uint32_t bmap = load_le32(good.data() + offsetof(vdi::HeaderLayout, offset_bmap));
  struct Case {
    const char* what;
    uint64_t at;
    uint32_t value;
    const char* message;
  };
  for (const Case& c :
       {Case{"duplicate", bmap + 4, 0, "named by two blocks"},
        Case{"past blocks_allocated", offsetof(vdi::HeaderLayout, blocks_allocated), 1, "not below blocks_allocated"},
        Case{"above blocks_in_image", offsetof(vdi::HeaderLayout, blocks_allocated), 1000, "above blocks_in_image"}}) {
    auto bad = good;
    store_le32(bad.data() + c.at, c.value);
    io::MemFileOptions mo;
    ImageOptions o;
    o.file.writable = true;
    auto d = run(open_vdi(std::make_unique<io::MemFile>(mo, bad), at("i.vdi"), o));
    ASSERT_FALSE(d.is_ok()) << c.what;
    EXPECT_EQ(d.status().code(), EIO) << c.what;
    EXPECT_NE(d.status().message().find(c.message), std::string::npos) << c.what << ": " << d.status().message();
    EXPECT_NE(d.status().message().find("read-only"), std::string::npos) << d.status().message();
    o.file.writable = false;
    EXPECT_TRUE(run(open_vdi(std::make_unique<io::MemFile>(mo, bad), at("i.vdi"), o)).is_ok()) << c.what;
  }
}

// qemu-img puts the data area right after the block map (4608 bytes here):
// the first block of an image with none allocated moves it to the next 1 MiB
// boundary (VirtualBox's alignment), in the header written back with the
// first entries, so that every data block is a whole aligned MiB. QEMU checks
// the image clean and reads what we read. An image with a block allocated
// keeps its data area where it is.
TEST_F(VdiWrite, TheFirstBlockOfAnEmptyImageAlignsItsDataArea) {
  sh(fmt::format("qemu-img create -q -f vdi i.vdi {}", kDisk));
  const Bytes empty = read_file(at("i.vdi"));
  const uint32_t old_data = layout_of(empty).offset_data;
  ASSERT_NE(old_data % vdi::kDataAlign, 0u) << "qemu-img's data area is aligned already: nothing to show";
  io::MemFile* f = nullptr;
  auto d = open(empty, &f);
  ASSERT_TRUE(d);
  ASSERT_TRUE(run(d->write(kMiB - 4096, pattern(3 * kMiB, 0x42))));
  ASSERT_TRUE(run(d->flush()));
  const Layout l = layout_of(f->durable_content());
  EXPECT_EQ(l.offset_data, (old_data + vdi::kDataAlign - 1) / vdi::kDataAlign * vdi::kDataAlign);
  EXPECT_EQ(l.offset_data, kMiB);
  EXPECT_EQ(l.blocks_allocated, 4u);
  EXPECT_EQ(l.entries, (std::vector<uint32_t>{0, 1, 2, 3, vdi::kUnallocated, vdi::kUnallocated, vdi::kUnallocated,
                                              vdi::kUnallocated, vdi::kUnallocated}));
  const Bytes ours = view(*d);
  EXPECT_TRUE(all_are(std::span(ours).subspan(kMiB - 4096, 3 * kMiB), 0x42));
  ASSERT_TRUE(run(d->close()));
  expect_qemu_reads(f->content(), ours, "after the first blocks");
  std::string out;
  ASSERT_EQ(shell(fmt::format("qemu-img map --output=json -f vdi {}", at("c.vdi")), &out), 0) << out;
  EXPECT_NE(out.find(fmt::format("\"offset\": {}", l.offset_data)), std::string::npos) << out;

  // Once a block is allocated (by QEMU here), the data area stays.
  sh(fmt::format("qemu-img create -q -f vdi i.vdi {} && qemu-io -f vdi -c 'write -P 7 0 4k' i.vdi >/dev/null", kDisk));
  const Bytes one = read_file(at("i.vdi"));
  auto d2 = open(one, &f);
  ASSERT_TRUE(d2);
  ASSERT_TRUE(run(d2->write(5 * kMiB, pattern(kMiB, 0x43))));
  const Bytes ours2 = view(*d2);
  ASSERT_TRUE(run(d2->close()));
  EXPECT_EQ(layout_of(f->content()).offset_data, old_data);
  EXPECT_EQ(layout_of(f->content()).entries[5], 1u);
  expect_qemu_reads(f->content(), ours2, "after a block next to QEMU's");
}

// Block 2 discarded: block 8's data (the last data block) moves into data
// block 2, block 2's entry is VDI_DISCARDED, blocks_allocated drops by one and
// the file ends after the last allocated block, durably when the discard
// returns (no flush).
TEST_F(VdiWrite, DiscardOfAMiddleBlockMovesTheLastDataBlockIntoItsPlace) {
  const Bytes base = make_blocks();
  const Layout before = layout_of(base);
  ASSERT_EQ(before.blocks_allocated, kBlocks);
  ASSERT_EQ(before.entries, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  const uint64_t allocated = f->allocated_bytes();
  ASSERT_TRUE(run(d->discard(2 * kMiB, kMiB)));
  EXPECT_TRUE(all_are(read(*d, 2 * kMiB, kMiB), 0));
  EXPECT_TRUE(all_are(read(*d, 8 * kMiB, kDisk - 8 * kMiB), 0x18));
  const Layout durable = layout_of(f->durable_content());
  EXPECT_EQ(durable.blocks_allocated, kBlocks - 1);
  EXPECT_EQ(durable.entries, (std::vector<uint32_t>{0, 1, vdi::kDiscarded, 3, 4, 5, 6, 7, 2}));
  EXPECT_EQ(f->size(), before.offset_data + (kBlocks - 1) * kMiB);
  EXPECT_GE(allocated - f->allocated_bytes(), kMiB) << "the vacated block's space was not given back";
  const Bytes ours = view(*d);
  ASSERT_TRUE(run(d->close()));
  EXPECT_EQ(layout_of(f->content()).entries, durable.entries);
  expect_qemu_reads(f->content(), ours, "after close");
}

// The last data block discarded: nothing moves, the file is cut.
TEST_F(VdiWrite, DiscardOfTheLastDataBlockMovesNothing) {
  const Bytes base = make_blocks();
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  const uint64_t written = f->counters().bytes_written;
  ASSERT_TRUE(run(d->discard(8 * kMiB, kDisk - 8 * kMiB)));  // the disk's end cuts block 8: whole
  EXPECT_LT(f->counters().bytes_written - written, kMiB) << "a block was copied";
  const Layout l = layout_of(f->durable_content());
  EXPECT_EQ(l.blocks_allocated, kBlocks - 1);
  EXPECT_EQ(l.entries, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, vdi::kDiscarded}));
  EXPECT_EQ(f->size(), l.offset_data + (kBlocks - 1) * kMiB);
  const Bytes ours = view(*d);
  EXPECT_TRUE(all_are(std::span(ours).subspan(8 * kMiB), 0));
  ASSERT_TRUE(run(d->close()));
  expect_qemu_reads(f->content(), ours, "after close");
}

// Blocks 6 and 7 in one discard: the new count is 7, data block 7 is freed
// with them, so only block 8 moves (into data block 6). Then blocks 1-4: the
// count drops to 3, blocks 5 and 8 (data blocks 5 and 6) move into the freed
// data blocks below it (1 and 2); freed data blocks 3 and 4 lie past it.
TEST_F(VdiWrite, ManyBlocksInOneDiscardFillTheFreedDataBlocksBelowTheNewCount) {
  const Bytes base = make_blocks();
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  const uint32_t x = vdi::kDiscarded;
  ASSERT_TRUE(run(d->discard(6 * kMiB, 2 * kMiB)));
  Layout l = layout_of(f->durable_content());
  EXPECT_EQ(l.blocks_allocated, 7u);
  EXPECT_EQ(l.entries, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, x, x, 6}));
  ASSERT_TRUE(run(d->discard(kMiB - 512, 4 * kMiB + 1024)));  // 1-4 whole, 0 and 5 in part
  l = layout_of(f->durable_content());
  EXPECT_EQ(l.blocks_allocated, 3u);
  EXPECT_EQ(l.entries, (std::vector<uint32_t>{0, x, x, x, x, 1, x, x, 2}));
  EXPECT_EQ(f->size(), l.offset_data + 3 * kMiB);
  const Bytes ours = view(*d);
  EXPECT_TRUE(all_are(std::span(ours).first(kMiB - 512), 0x10));
  EXPECT_TRUE(all_are(std::span(ours).subspan(kMiB - 512, 4 * kMiB + 1024), 0));
  EXPECT_TRUE(all_are(std::span(ours).subspan(5 * kMiB + 512, kMiB - 512), 0x15));
  EXPECT_TRUE(all_are(std::span(ours).subspan(6 * kMiB, 2 * kMiB), 0));
  EXPECT_TRUE(all_are(std::span(ours).subspan(8 * kMiB), 0x18));
  ASSERT_TRUE(run(d->close()));
  expect_qemu_reads(f->content(), ours, "after close");
}

// Every block discarded at once: no data block is left, the file ends where
// the data would begin; writes afterwards allocate from data block 0 again.
TEST_F(VdiWrite, DiscardOfEveryBlockLeavesNoDataBlock) {
  const Bytes base = make_blocks();
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  ASSERT_TRUE(run(d->discard(0, kDisk)));
  Layout l = layout_of(f->durable_content());
  EXPECT_EQ(l.blocks_allocated, 0u);
  EXPECT_EQ(l.entries, std::vector<uint32_t>(kBlocks, vdi::kDiscarded));
  EXPECT_EQ(f->size(), l.offset_data);
  EXPECT_TRUE(all_are(view(*d), 0));
  ASSERT_TRUE(run(d->write(5 * kMiB + 4096, pattern(4096, 0x55))));
  const Bytes ours = view(*d);
  ASSERT_TRUE(run(d->close()));
  l = layout_of(f->content());
  EXPECT_EQ(l.blocks_allocated, 1u);
  EXPECT_EQ(l.entries[5], 0u);
  expect_qemu_reads(f->content(), ours, "after close");
}

// A write after a discard gets the data block the discard vacated (index
// blocks_allocated, as QEMU allocates), reading zeros around its data: the
// old bytes there are gone with the cut file.
TEST_F(VdiWrite, AWriteAfterADiscardTakesTheFreedIndex) {
  const Bytes base = make_blocks();
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  ASSERT_TRUE(run(d->discard(3 * kMiB, kMiB)));
  ASSERT_TRUE(run(d->write(3 * kMiB + 8192, pattern(4096, 0x66))));
  const Bytes block3 = read(*d, 3 * kMiB, kMiB);
  EXPECT_TRUE(all_are(std::span(block3).first(8192), 0));
  EXPECT_TRUE(all_are(std::span(block3).subspan(8192, 4096), 0x66));
  EXPECT_TRUE(all_are(std::span(block3).subspan(12288), 0)) << "old bytes show in the reused data block";
  const Bytes ours = view(*d);
  ASSERT_TRUE(run(d->close()));
  const Layout l = layout_of(f->content());
  EXPECT_EQ(l.blocks_allocated, kBlocks);
  EXPECT_EQ(l.entries, (std::vector<uint32_t>{0, 1, 2, 8, 4, 5, 6, 7, 3}));
  EXPECT_EQ(f->size(), l.offset_data + kBlocks * kMiB);
  expect_qemu_reads(f->content(), ours, "after close");
}

// A discard that covers part of a block punches it in place, and zeroing
// without unmap zeroes in place: the blocks stay allocated where they were.
TEST_F(VdiWrite, PartialDiscardsAndZeroingWithoutUnmapKeepTheBlocks) {
  const Bytes base = make_blocks();
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  ASSERT_TRUE(run(d->discard(kMiB + 4096, kMiB - 8192)));
  ASSERT_TRUE(run(d->write_zeroes(4 * kMiB, kMiB, false)));
  const Bytes ours = view(*d);
  EXPECT_TRUE(all_are(std::span(ours).subspan(kMiB, 4096), 0x11));
  EXPECT_TRUE(all_are(std::span(ours).subspan(kMiB + 4096, kMiB - 8192), 0));
  EXPECT_TRUE(all_are(std::span(ours).subspan(4 * kMiB, kMiB), 0));
  ASSERT_TRUE(run(d->close()));
  EXPECT_EQ(layout_of(f->content()).entries, layout_of(base).entries);
  EXPECT_EQ(layout_of(f->content()).blocks_allocated, kBlocks);
  EXPECT_EQ(f->size(), base.size());
  expect_qemu_reads(f->content(), ours, "after close");
}

// A static image keeps every block where it is: discarded blocks are zeroed
// (punched) in place, nothing moves, blocks_allocated stays.
TEST_F(VdiWrite, StaticImagesZeroDiscardedBlocksInPlace) {
  const Bytes base = make_blocks("static=on");
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  const uint64_t allocated = f->allocated_bytes();
  ASSERT_TRUE(run(d->discard(2 * kMiB, 2 * kMiB)));
  EXPECT_GE(allocated - f->allocated_bytes(), 2 * kMiB - 4096);  // whole host pages only
  const Bytes ours = view(*d);
  EXPECT_TRUE(all_are(std::span(ours).subspan(2 * kMiB, 2 * kMiB), 0));
  ASSERT_TRUE(run(d->close()));
  EXPECT_EQ(layout_of(f->content()).entries, layout_of(base).entries);
  EXPECT_EQ(layout_of(f->content()).blocks_allocated, layout_of(base).blocks_allocated);
  EXPECT_EQ(f->size(), base.size());
  expect_qemu_reads(f->content(), ours, "after close");
}

// A failed copy cancels the move: the discarded block is zeroed in place and
// keeps its data block, the block that was to move stays, blocks_allocated
// too; the image stays clean.
TEST_F(VdiWrite, AFailedMoveLeavesTheDiscardedBlockZeroedInPlace) {
  const Bytes base = make_blocks();
  io::MemFile* f = nullptr;
  auto d = open(base, &f);
  ASSERT_TRUE(d);
  f->fail_nth(io::OpKind::write, 1, EIO);  // the copy into data block 2
  EXPECT_EQ(run(d->discard(2 * kMiB, kMiB)).code(), EIO);
  const Bytes ours = view(*d);
  EXPECT_TRUE(all_are(std::span(ours).subspan(2 * kMiB, kMiB), 0));
  EXPECT_TRUE(all_are(std::span(ours).subspan(8 * kMiB), 0x18));
  ASSERT_TRUE(run(d->close()));
  const Layout l = layout_of(f->content());
  EXPECT_EQ(l.entries, layout_of(base).entries);
  EXPECT_EQ(l.blocks_allocated, kBlocks);
  expect_qemu_reads(f->content(), ours, "after close");
}

// Runs t detached on the test's engine; done is set when it finishes.
void start(io::Engine& engine, Task<Status> t, bool& done, Status& result) {
  io::ScopedEngine scope(&engine);
  spawn_then(std::move(t), [&](Status st) {
    result = std::move(st);
    done = true;
  });
}

// Lets the engine run a while (timers of a waiting compaction included).
void spin(io::Engine& engine, int rounds = 30) {
  io::ScopedEngine scope(&engine);
  for (int i = 0; i < rounds; ++i) engine.run_once(1);
}

// A write into block 8 that looked it up before block 2's discard is held in
// flight at data block 8: the move of block 8 waits for it, so the copy holds
// its bytes. A second write into block 8, made while the move waits, does not
// go to the old place lock-free (it would be lost after the copy): it waits
// for the move and lands in data block 2.
TEST_F(VdiWrite, WritesIntoAMovingBlockAreNotLost) {
  const Bytes base = make_blocks();
  const uint64_t l8 = layout_of(base).offset_data + 8 * kMiB;
  io::MemFile mem(io::MemFileOptions{}, base);
  auto gated = std::make_unique<GatedFile>(mem);
  GatedFile* gate = gated.get();
  auto d = open(std::move(gated));
  ASSERT_TRUE(d);
  ASSERT_TRUE(run(d->write(kMiB, pattern(512, 0x21))));  // the first write of the open is behind us
  gate->arm(GatedFile::Kind::write, l8, l8 + kMiB);
  const Bytes first = pattern(512, 0x77), second = pattern(512, 0x78);
  bool w1 = false, w2 = false, discarded = false;
  Status r1, r2, rd;
  start(*engine_, d->write(8 * kMiB, first), w1, r1);
  ASSERT_EQ(gate->waiting(), 1u);
  start(*engine_, d->discard(2 * kMiB, kMiB), discarded, rd);
  spin(*engine_);
  EXPECT_FALSE(discarded) << "the move did not wait for the write in flight";
  start(*engine_, d->write(8 * kMiB + 1024, second), w2, r2);
  spin(*engine_);
  EXPECT_EQ(gate->waiting(), 1u) << "a write into the moving block went to its old place";
  EXPECT_FALSE(w2);
  gate->disarm();
  gate->release_first();
  {
    io::ScopedEngine scope(engine_.get());
    while (!(w1 && w2 && discarded)) engine_->run_once(100);
  }
  ASSERT_TRUE(r1) << r1.to_string();
  ASSERT_TRUE(r2) << r2.to_string();
  ASSERT_TRUE(rd) << rd.to_string();
  const Bytes block8 = read(*d, 8 * kMiB, kDisk - 8 * kMiB);
  EXPECT_TRUE(all_are(std::span(block8).first(512), 0x77));
  EXPECT_TRUE(all_are(std::span(block8).subspan(512, 512), 0x18));
  EXPECT_TRUE(all_are(std::span(block8).subspan(1024, 512), 0x78));
  const Bytes ours = view(*d);
  ASSERT_TRUE(run(d->close()));
  EXPECT_EQ(layout_of(mem.content()).entries[8], 2u);
  expect_qemu_reads(mem.content(), ours, "after close");
}

// A read of block 2 that looked it up before block 2's discard is held in
// flight at data block 2: block 8's data is not copied there until it
// completed, so it reads block 2's old bytes, never block 8's.
TEST_F(VdiWrite, AReadInFlightNeverSeesTheBlockMovedIntoItsPlace) {
  const Bytes base = make_blocks();
  const uint64_t l2 = layout_of(base).offset_data + 2 * kMiB;
  io::MemFile mem(io::MemFileOptions{}, base);
  auto gated = std::make_unique<GatedFile>(mem);
  GatedFile* gate = gated.get();
  auto d = open(std::move(gated));
  ASSERT_TRUE(d);
  gate->arm(GatedFile::Kind::read, l2, l2 + kMiB);
  Bytes buf(kMiB);
  bool read_done = false, discarded = false;
  Status rr, rd;
  start(*engine_, d->read(2 * kMiB, buf), read_done, rr);
  ASSERT_EQ(gate->waiting(), 1u);
  start(*engine_, d->discard(2 * kMiB, kMiB), discarded, rd);
  spin(*engine_);
  EXPECT_FALSE(discarded) << "the move did not wait for the read in flight";
  const Bytes now = mem.content();
  EXPECT_TRUE(all_are(std::span(now).subspan(l2, kMiB), 0x12)) << "block 8 was copied under the read";
  gate->disarm();
  gate->release_first();
  {
    io::ScopedEngine scope(engine_.get());
    while (!(read_done && discarded)) engine_->run_once(100);
  }
  ASSERT_TRUE(rr) << rr.to_string();
  ASSERT_TRUE(rd) << rd.to_string();
  EXPECT_TRUE(all_are(buf, 0x12)) << "a read in flight saw another block's data";
  EXPECT_TRUE(all_are(read(*d, 8 * kMiB, kDisk - 8 * kMiB), 0x18));
  const Bytes ours = view(*d);
  ASSERT_TRUE(run(d->close()));
  EXPECT_EQ(layout_of(mem.content()).entries[8], 2u);
  expect_qemu_reads(mem.content(), ours, "after close");
}

// What the guest may find after a crash: every sector it did not change
// since the last completed flush as it was then.
struct Model {
  Bytes now = Bytes(kDisk);
  Bytes durable = Bytes(kDisk);
  std::vector<bool> touched = std::vector<bool>((kDisk + 511) / 512);
  void change(uint64_t off, uint64_t len, const Bytes* data) {
    for (uint64_t s = off / 512; s <= (off + len - 1) / 512; ++s) touched[s] = true;
    if (data) {
      std::copy(data->begin(), data->end(), now.begin() + static_cast<ptrdiff_t>(off));
    } else {
      std::fill_n(now.begin() + static_cast<ptrdiff_t>(off), len, std::byte{0});
    }
  }
  void flushed() {
    durable = now;
    std::fill(touched.begin(), touched.end(), false);
  }
};

// Discards that move blocks, writes into vacated and moved blocks, flushes:
// cut at every host operation (every later one fails, as after a power
// loss), every image the host could hold (as written, and with unflushed
// writes dropped and reordered) is clean for qemu-img check, opens writable,
// and holds every sector flushed before the cut and not changed since.
TEST_F(VdiWrite, EveryCrashPointOfDiscardsWithMovesLeavesACleanImage) {
  Bytes base = make_blocks();
  std::mt19937_64 rng(11);
  int cuts = 0;
  for (uint64_t k = 1; k < 400 && !HasFailure(); k += io::testing::kSanitizerScale) {
    io::MemFile* f = nullptr;
    auto d = open(base, &f);
    ASSERT_TRUE(d);
    Model m;
    m.now = view(*d);
    m.flushed();
    const uint64_t ops = f->counters().total();
    f->fail_from(io::OpKind::any, k, EIO);
    bool failed = false;
    auto step = [&](Task<Status> t, uint64_t off, uint64_t len, const Bytes* data) {
      if (failed) return;
      if (len > 0) m.change(off, len, data);
      if (!run(std::move(t))) failed = true;
    };
    const Bytes a = pattern(1024, 0x61), b = pattern(kMiB, 0x62), c = pattern(4096, 0x63);
    step(d->discard(2 * kMiB, kMiB), 2 * kMiB, kMiB, nullptr);                 // 8 moves into 2
    step(d->write(8 * kMiB + 512, a), 8 * kMiB + 512, a.size(), &a);            // into the moved block
    step(d->discard(kMiB, kMiB), kMiB, kMiB, nullptr);                          // 7 moves into 1
    step(d->write(2 * kMiB, b), 2 * kMiB, b.size(), &b);                        // a vacated data block
    if (!failed && run(d->flush())) m.flushed();
    step(d->discard(4 * kMiB, 3 * kMiB), 4 * kMiB, 3 * kMiB, nullptr);          // 4-6: 2 and 8 move
    step(d->write(5 * kMiB + 4096, c), 5 * kMiB + 4096, c.size(), &c);
    step(d->discard(0, kDisk), 0, kDisk, nullptr);                              // everything
    step(d->write(3 * kMiB, a), 3 * kMiB, a.size(), &a);
    if (!failed && run(d->flush())) m.flushed();
    if (f->counters().total() - ops < k) break;  // the cut came after the last operation
    ++cuts;
    const std::string where = fmt::format("cut at operation {}", k);
    for (const Bytes& image : {f->content(), f->crash_image(rng()), f->crash_image(rng())}) {
      const Bytes raw = qemu_raw_of_distinct(image, where);
      ASSERT_EQ(raw.size(), kDisk) << where;
      for (uint64_t s = 0; s < m.touched.size(); ++s) {
        const uint64_t n = std::min<uint64_t>(512, kDisk - s * 512);
        if (!m.touched[s] && std::memcmp(raw.data() + s * 512, m.durable.data() + s * 512, n) != 0) {
          ADD_FAILURE() << where << ": flushed data lost at guest offset " << s * 512;
          break;
        }
      }
      auto again = open(std::make_unique<io::MemFile>(io::MemFileOptions{}, image));
      ASSERT_TRUE(again) << where;
      EXPECT_TRUE(view(*again) == raw) << where << ": QEMU and qcowfs read the image otherwise";
    }
  }
  EXPECT_GE(cuts, 50 / io::testing::kSanitizerScale);  // 57 host operations today
}

}  // namespace
}  // namespace qcowfs::image
