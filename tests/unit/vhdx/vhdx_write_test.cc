// VHDX read-write (image/vhdx/writer.h, log_writer.h, log.h): our log entries
// replayed by QEMU, QEMU's log replayed by us, the header updates before the
// first write, a crash at every step of a BAT update, refusals of images a
// writer could corrupt, hostile logs (nothing written, a clear error), and
// discard: whole blocks of a dynamic image unmapped (PAYLOAD_BLOCK_UNMAPPED),
// their space punched and reused once written back and no I/O that saw them
// is in flight; fixed images zeroed in place.
// Images are made by qemu-img/qemu-io, edited with unit/vhdx/vhdx_test_edit.h,
// and opened from memory (MemFile).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "unit/image/forwarding_file.h"
#include "image/endian.h"
#include "image/vhdx/format.h"
#include "image/vhdx/header.h"
#include "image/vhdx/log_writer.h"
#include "image/vhdx/vhdx.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "io/run_sync.h"
#include "io/sync.h"
#include "unit/io/io_test_util.h"
#include "unit/vhdx/vhdx_test_edit.h"

namespace qcowfs::image {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;
using vhdx::kMiB;
using vhdx::testing::Editor;
using vhdx::testing::LogWrite;
using vhdx::testing::log_entry;

constexpr uint64_t kDisk = 16 * kMiB;

Bytes pattern(size_t n, uint8_t v) { return Bytes(n, std::byte{v}); }

bool all_are(std::span<const std::byte> s, uint8_t v) {
  return std::all_of(s.begin(), s.end(), [v](std::byte b) { return b == std::byte{v}; });
}

// Reads of host bytes [lo, hi) wait, once armed, until the gate opens: a
// lock-free read kept in flight between its map lookup and its host read.
class GatedReads final : public qcowfs::testing::ForwardingFile {
 public:
  explicit GatedReads(io::HostFile& f) : ForwardingFile(f) {}
  void arm(uint64_t lo, uint64_t hi) {
    lo_ = lo;
    hi_ = hi;
    gate_ = std::make_unique<io::AsyncEvent>();
  }
  void open_gate() { gate_->set(); }
  int waiting() const { return waiting_; }
  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override {
    if (gate_ && off < hi_ && lo_ < off + buf.size()) {
      ++waiting_;
      co_await gate_->wait();
      --waiting_;
    }
    co_return co_await inner().read(off, buf);
  }

 private:
  uint64_t lo_ = 0, hi_ = 0;
  std::unique_ptr<io::AsyncEvent> gate_;
  int waiting_ = 0;  // touched only on the test's engine thread
};

class VhdxWrite : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path("/var/tmp") / ("qcowfs_vhdx_write_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    auto e = io::make_engine(io::EngineKind::threads);
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(*e);
  }
  void TearDown() override { fs::remove_all(dir_); }

  template <typename T>
  T run(Task<T> t) {
    return io::run_sync(*engine_, std::move(t));
  }

  // Shell commands (qemu-img, qemu-io) in the scratch directory.
  int sh_rc(const std::string& commands, std::string* out = nullptr) {
    const std::string cmd = "cd '" + dir_.string() + "' && { " + commands + "; } 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    std::string text;
    char buf[512];
    while (size_t n = std::fread(buf, 1, sizeof buf, p)) text.append(buf, n);
    const int rc = ::pclose(p);
    if (out) *out = text;
    return rc;
  }
  void sh(const std::string& commands) {
    std::string out;
    ASSERT_EQ(sh_rc(commands, &out), 0) << commands << "\n" << out;
  }
  // i.vhdx: 16 MiB, 1 MiB blocks; data at block 0 and block 9.
  void make_base() {
    sh("qemu-img create -q -f vhdx -o block_size=1M i.vhdx 16M && "
       "qemu-io -c 'write -P 0x11 0 1M' -c 'write -P 0x33 9M 1M' i.vhdx >/dev/null");
  }
  // i.vhdx: 16 MiB, 1 MiB blocks; 0x11 in blocks 0-3 (contiguous in the
  // file), 0x33 in block 9.
  void make_blocks() {
    sh("qemu-img create -q -f vhdx -o block_size=1M i.vhdx 16M && "
       "qemu-io -c 'write -P 0x11 0 4M' -c 'write -P 0x33 9M 1M' i.vhdx >/dev/null");
  }
  // The BAT entries (as on disk) of payload blocks `blocks` of image `img`.
  std::vector<uint64_t> bat_of(const Bytes& img, const std::vector<uint64_t>& blocks) {
    const Editor e(img);
    std::vector<uint64_t> entries;
    for (uint64_t b : blocks) entries.push_back(e.bat(e.bat_index(b)));
    return entries;
  }
  // Loads image `name` of the scratch directory, lets `change` edit it, saves it.
  template <typename F>
  void edit(const std::string& name, F change) {
    auto e = Editor::load((dir_ / name).string());
    change(e);
    e.save((dir_ / name).string());
  }
  // The whole disk as the driver reads it.
  Bytes view(BlockDriver& d) { return read(d, 0, kDisk); }
  Bytes slurp(const std::string& name) { return io::testing::read_file((dir_ / name).string()); }
  void spit(const std::string& name, const Bytes& b) {
    std::ofstream out(dir_ / name, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  // A driver over a MemFile holding `content`; *file_out (if given) is the
  // file, alive while the driver is. no_writes: every write fails (EXDEV).
  Result<std::unique_ptr<BlockDriver>> open(const Bytes& content, bool writable, io::MemFile** file_out = nullptr,
                                            bool track = false, bool no_writes = false) {
    io::MemFileOptions o;
    o.path = (dir_ / "i.vhdx").string();
    o.track_unflushed = track;
    auto f = std::make_unique<io::MemFile>(o, content);
    if (file_out) *file_out = f.get();
    if (no_writes) f->fail_from(io::OpKind::write, 1, EXDEV);
    ImageOptions opts;
    opts.file.writable = writable;
    return run(open_vhdx(std::move(f), o.path, opts));
  }
  Bytes read(BlockDriver& d, uint64_t off, size_t len) {
    Bytes b(len);
    EXPECT_TRUE(run(d.read(off, b)));
    return b;
  }
  // What qemu-img convert reads of `name` (which qemu-img check must pass).
  Bytes qemu_raw(const std::string& name) {
    sh("qemu-img check -q -f vhdx " + name + " && qemu-img convert -f vhdx -O raw " + name + " " + name + ".raw");
    return slurp(name + ".raw");
  }
  // The image after our replay: a writable open and close.
  Bytes our_replay(const Bytes& image) {
    io::MemFile* f = nullptr;
    auto d = open(image, true, &f);
    EXPECT_TRUE(d) << d.status().to_string();
    if (!d) return image;
    EXPECT_TRUE(run((*d)->close()));
    return f->content();
  }

  fs::path dir_;
  std::unique_ptr<io::Engine> engine_;
};

struct HeaderView {
  bool valid = false;
  uint64_t seq = 0;
  Bytes file_write_guid, data_write_guid, log_guid;
};

HeaderView header_at(const Bytes& img, int index) {
  namespace f = vhdx::header_field;
  const std::byte* b = img.data() + vhdx::kHeaderOffsets[index];
  HeaderView v;
  auto chosen = vhdx::choose_header(std::span(b, vhdx::kHeaderSize), Bytes(vhdx::kHeaderSize), "t");
  v.valid = chosen.is_ok();
  v.seq = load_le64(b + f::kSequenceNumber);
  v.file_write_guid.assign(b + f::kFileWriteGuid, b + f::kFileWriteGuid + 16);
  v.data_write_guid.assign(b + f::kDataWriteGuid, b + f::kDataWriteGuid + 16);
  v.log_guid.assign(b + f::kLogGuid, b + f::kLogGuid + 16);
  return v;
}

HeaderView current_header(const Bytes& img) {
  HeaderView a = header_at(img, 0), b = header_at(img, 1);
  if (!a.valid) return b;
  if (!b.valid) return a;
  return a.seq >= b.seq ? a : b;
}

TEST_F(VhdxWrite, OurLogEntryIsReplayedByQemu) {
  make_base();
  const Bytes base = slurp("i.vhdx");
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  ASSERT_TRUE(run((*d)->write(2 * kMiB + 4096, pattern(64 * 1024, 0x5a))));  // a new block
  ASSERT_TRUE(run((*d)->write(5 * kMiB - 512, pattern(1024, 0x6b))));        // two new blocks
  ASSERT_TRUE(run((*d)->write(100 * 1024, pattern(4096, 0x7c))));            // in place
  // The flush writes two headers, the log entry, then the BAT in place: that write fails.
  f->fail_nth(io::OpKind::write, 4, EIO);
  EXPECT_FALSE(run((*d)->flush()));
  spit("c.vhdx", f->content());
  std::string out;
  EXPECT_NE(sh_rc("qemu-img info c.vhdx", &out), 0);
  EXPECT_NE(out.find("needs to be replayed"), std::string::npos) << out;
  // qemu-io opens read-write: QEMU replays our entry.
  ASSERT_EQ(sh_rc("qemu-io -f vhdx -c 'read -P 0x5a 2052k 64k' -c 'read -P 0x6b 5242368 1k' "
                  "-c 'read -P 0x7c 100k 4k' -c 'read -P 0 2M 4k' -c 'read -P 0x11 0 100k' c.vhdx",
                  &out),
            0);
  EXPECT_EQ(out.find("failed"), std::string::npos) << out;
  ASSERT_EQ(sh_rc("qemu-img info c.vhdx", &out), 0) << out;  // replayed: opens read-only now
  const Bytes theirs = qemu_raw("c.vhdx");
  // Our own replay of the same image reads the same.
  spit("o.vhdx", our_replay(f->content()));
  EXPECT_TRUE(qemu_raw("o.vhdx") == theirs);
}

TEST_F(VhdxWrite, WeReplayALogQemuLeft) {
  make_base();
  // blkdebug fails QEMU's in-place BAT write: its log entry stays, pending.
  const uint64_t bat_sector = Editor::load((dir_ / "i.vhdx").string()).bat_offset() / 512;
  sh("s=" + std::to_string(bat_sector) + " && "
     "printf '[inject-error]\\nevent = \"pwritev\"\\niotype = \"write\"\\nerrno = \"5\"\\nsector = \"%s\"\\nonce = "
     "\"on\"\\n' $s > bd.conf && "
     "cp i.vhdx q.vhdx && "
     "! qemu-io -f vhdx -c 'write -P 0x5a 4M 64k' blkdebug:bd.conf:q.vhdx && ! qemu-img info q.vhdx");
  const Bytes pending = slurp("q.vhdx");
  auto ro = open(pending, false);
  ASSERT_FALSE(ro);
  EXPECT_EQ(ro.status().code(), EPERM);
  io::MemFile* f = nullptr;
  auto d = open(pending, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(read(**d, 4 * kMiB, 64 * 1024), pattern(64 * 1024, 0x5a));
  EXPECT_EQ(read(**d, 0, 4096), pattern(4096, 0x11));
  ASSERT_TRUE(run((*d)->close()));
  EXPECT_EQ(current_header(f->content()).log_guid, Bytes(16));
  spit("o.vhdx", f->content());
  spit("q2.vhdx", pending);
  sh("qemu-img check -q -r all q2.vhdx");
  EXPECT_TRUE(qemu_raw("o.vhdx") == qemu_raw("q2.vhdx"));
}

TEST_F(VhdxWrite, HeadersAreUpdatedDurablyBeforeTheFirstWrite) {
  make_base();
  const Bytes base = slurp("i.vhdx");
  const HeaderView before = current_header(base);
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d);
  EXPECT_TRUE(f->content() == base);       // an open writes nothing
  f->fail_nth(io::OpKind::write, 1, EIO);  // the first header write
  EXPECT_FALSE(run((*d)->write(4096, pattern(512, 0x42))));
  EXPECT_TRUE(f->content() == base);  // no data before the headers
  const uint64_t flushes = f->counters().flushes;
  ASSERT_TRUE(run((*d)->write(4096, pattern(512, 0x42))));
  EXPECT_EQ(f->counters().flushes - flushes, 2u);  // each header flushed
  const Bytes after = f->content();
  HeaderView h0 = header_at(after, 0), h1 = header_at(after, 1);
  ASSERT_TRUE(h0.valid && h1.valid);
  EXPECT_EQ(std::max(h0.seq, h1.seq), before.seq + 2);
  EXPECT_EQ(std::min(h0.seq, h1.seq), before.seq + 1);
  for (const HeaderView* h : {&h0, &h1}) {
    EXPECT_NE(h->data_write_guid, before.data_write_guid);
    EXPECT_NE(h->file_write_guid, before.file_write_guid);
    EXPECT_EQ(h->log_guid, Bytes(16));
  }
  EXPECT_EQ(h0.file_write_guid, h1.file_write_guid);  // one per open, as QEMU's session GUID
  // A BAT update: two headers with a log GUID, the entry, the BAT, two headers without.
  ASSERT_TRUE(run((*d)->write(6 * kMiB, pattern(512, 0x43))));
  ASSERT_TRUE(run((*d)->flush()));
  const HeaderView logged = current_header(f->content());
  EXPECT_EQ(logged.seq, before.seq + 6);
  EXPECT_EQ(logged.log_guid, Bytes(16));
  ASSERT_TRUE(run((*d)->close()));
  spit("c.vhdx", f->content());
  const Bytes raw = qemu_raw("c.vhdx");
  EXPECT_EQ(Bytes(raw.begin() + 6 * kMiB, raw.begin() + 6 * kMiB + 512), pattern(512, 0x43));
}

// Every host operation of a flush that writes the BAT through the log fails
// in turn (the rest of the flush never happens); the image, with or without
// its unflushed writes, opens after our replay and QEMU's with the data
// flushed before intact and the same bytes in both.
TEST_F(VhdxWrite, ACrashAtEveryStepOfABatUpdateReplays) {
  make_base();
  const Bytes base = slurp("i.vhdx");
  std::mt19937_64 rng(11);
  int crash_points = 0;
  for (uint64_t k = 1; k < 40 && !HasFailure(); k += io::testing::kSanitizerScale) {
    io::MemFile* f = nullptr;
    auto d = open(base, true, &f, true);
    ASSERT_TRUE(d);
    ASSERT_TRUE(run((*d)->write(3 * kMiB, pattern(8192, 0x21))));  // flushed: must survive
    ASSERT_TRUE(run((*d)->flush()));
    ASSERT_TRUE(run((*d)->write(7 * kMiB + 512, pattern(kMiB + kMiB / 2, 0x22))));  // new blocks, not flushed
    const uint64_t ops = f->counters().total();
    f->fail_nth(io::OpKind::any, k, EIO);
    if (run((*d)->flush())) {
      EXPECT_GT(f->counters().total() - ops, 10u);  // headers, log, BAT: every step had its turn
      break;
    }
    ++crash_points;
    for (const Bytes& image : {f->content(), f->crash_image(rng())}) {
      const Bytes ours = our_replay(image);
      auto ro = open(ours, false);
      ASSERT_TRUE(ro) << "step " << k << ": " << ro.status().to_string();
      EXPECT_EQ(read(**ro, 3 * kMiB, 8192), pattern(8192, 0x21)) << "step " << k;
      const Bytes new_data = read(**ro, 7 * kMiB + 512, kMiB + kMiB / 2);
      EXPECT_TRUE(new_data == pattern(kMiB + kMiB / 2, 0x22) || new_data == pattern(kMiB + kMiB / 2, 0))
          << "step " << k;
      spit("ours.vhdx", ours);
      spit("theirs.vhdx", image);
      sh("qemu-img check -q -r all theirs.vhdx");
      EXPECT_TRUE(qemu_raw("ours.vhdx") == qemu_raw("theirs.vhdx")) << "step " << k;
    }
  }
  EXPECT_GE(crash_points, 10 / io::testing::kSanitizerScale);
}

TEST_F(VhdxWrite, NewBlocksGoAtTheEndOfTheFileInOneRunWithFullyPresentEntries) {
  make_base();
  const Bytes base = slurp("i.vhdx");
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d);
  const uint64_t end = (base.size() + kMiB - 1) / kMiB * kMiB;
  ASSERT_TRUE(run((*d)->write(1 * kMiB + 100, pattern(3 * kMiB, 0x55))));  // blocks 1..4
  ASSERT_TRUE(run((*d)->close()));
  const Bytes img = f->content();
  EXPECT_EQ(img.size(), end + 4 * kMiB);
  spit("c.vhdx", img);
  const std::vector<uint64_t> entries = bat_of(img, {1, 2, 3, 4});
  for (uint64_t i = 0; i < 4; ++i) EXPECT_EQ(entries[i], (end + i * kMiB) | vhdx::kFullyPresent) << i;
  const Bytes raw = qemu_raw("c.vhdx");
  EXPECT_EQ(Bytes(raw.begin() + kMiB, raw.begin() + kMiB + 100), Bytes(100));  // the block's head reads zeros
}

// A region reaching past the end of the file (here the metadata region, 32 MiB
// long): new blocks go after it, where QEMU would overlap it.
TEST_F(VhdxWrite, NewBlocksGoPastARegionBeyondTheEndOfTheFile) {
  sh("qemu-img create -q -f vhdx -o block_size=1M i.vhdx 16M");
  edit("i.vhdx", [](Editor& e) { e.set_region_length(vhdx::kMetadataGuid, 32 << 20); });
  const Bytes base = slurp("i.vhdx");
  ASSERT_LT(base.size(), 34 * kMiB);
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  ASSERT_TRUE(run((*d)->write(5 * kMiB, pattern(4096, 0x44))));
  ASSERT_TRUE(run((*d)->close()));
  spit("c.vhdx", f->content());
  const Editor c(f->content());
  const uint64_t block = c.bat(5) & vhdx::kBatOffsetMask, metadata = c.metadata_offset();
  EXPECT_GE(block, metadata + 32 * kMiB);
  const Bytes raw = qemu_raw("c.vhdx");
  EXPECT_EQ(Bytes(raw.begin() + 5 * kMiB, raw.begin() + 5 * kMiB + 4096), pattern(4096, 0x44));
}

TEST_F(VhdxWrite, BlocksPastAChunkUseTheInterleavedBatIndex) {
  // 1 MiB blocks: chunk ratio 4096, BAT index 4096 is a sector-bitmap entry.
  sh("qemu-img create -q -f vhdx -o block_size=1M i.vhdx 4200M");
  io::MemFile* f = nullptr;
  auto d = open(slurp("i.vhdx"), true, &f);
  ASSERT_TRUE(d);
  for (uint64_t block : {4095u, 4096u, 4097u})
    ASSERT_TRUE(run((*d)->write(block * kMiB + 4096, pattern(4096, static_cast<uint8_t>(block - 4000)))));
  ASSERT_TRUE(run((*d)->close()));
  spit("c.vhdx", f->content());
  sh("qemu-img check -q c.vhdx && "
     "qemu-io -f vhdx -r -c 'read -P 95 4193284k 4k' -c 'read -P 96 4194308k 4k' -c 'read -P 97 4195332k 4k' "
     "-c 'read -P 0 4096M 4k' -c 'read -P 0 4193280k 4k' c.vhdx | grep -c '^read' | grep -qx 5");
  const Editor c(f->content());
  std::vector<uint64_t> states;
  for (uint64_t i = 4095; i < 4099; ++i) states.push_back(c.bat(i) & vhdx::kBatStateMask);
  EXPECT_EQ(states, std::vector<uint64_t>({6, 0, 6, 6}));
}

TEST_F(VhdxWrite, WritableOpensOfImagesAWriterCouldCorruptAreRefused) {
  make_base();
  struct Case {
    const char* what;
    uint64_t (*entry3)(uint64_t entry0);  // BAT entry 3 from entry 0
  };
  const Case cases[] = {
      {"two blocks, one place", [](uint64_t e0) { return e0; }},
      {"PARTIALLY_PRESENT", [](uint64_t e0) { return (e0 & ~vhdx::kBatStateMask) | vhdx::kPartiallyPresent; }},
      {"straddles block 0",
       [](uint64_t e0) { return ((e0 + (1 << 19)) & ~vhdx::kBatStateMask) | vhdx::kFullyPresent; }},
  };
  for (const Case& c : cases) {
    const char* what = c.what;
    Editor e(slurp("i.vhdx"));
    e.set_bat(3, c.entry3(e.bat(0)));
    const Bytes img = e.bytes();
    auto d = open(img, true, nullptr, false, true);  // a write would fail the open with EXDEV
    ASSERT_FALSE(d) << what;
    EXPECT_EQ(d.status().code(), EIO) << what;
    EXPECT_NE(d.status().message().find("mount it read-only"), std::string::npos) << d.status().message();
    EXPECT_TRUE(open(img, false)) << what;  // read-only opens as before
  }
}

// Hostile logs, each in an entry with a valid checksum: a writable open fails
// with a clear error and writes nothing.
TEST_F(VhdxWrite, HostileLogsAreRefusedAndNothingIsWritten) {
  make_base();
  // Each case's entry from g (its log GUID), h (the current header's log
  // offset) and s (the file's size).
  using Entry = Bytes (*)(const vhdx::Guid& g, uint64_t h, uint64_t s);
  struct Case {
    const char* name;
    Entry entry;
    const char* message;
  };
  static const auto zeros = [](uint64_t at) { return std::vector<LogWrite>{{at, Bytes(4096)}}; };
  const Case cases[] = {
      {"into the headers",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) { return log_entry(g, 1, zeros(64 * 1024), s, s); },
       "into the headers"},
      {"into the region table",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) { return log_entry(g, 1, zeros(192 * 1024), s, s); },
       "into the headers"},
      {"into the log",
       [](const vhdx::Guid& g, uint64_t h, uint64_t s) { return log_entry(g, 1, zeros(h + 8192), s, s); },
       "into the log"},
      {"past the end",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) { return log_entry(g, 1, zeros(s + (1 << 20)), s, s); },
       "past the end of the file"},
      {"file truncated",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) {
         return log_entry(g, 1, zeros(3 << 20), s + (1 << 20), s + (1 << 20));
       },
       "truncated"},
      {"huge growth",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) { return log_entry(g, 1, zeros(3 << 20), s, 1ull << 50); },
       "more than qcowfs replays"},
      {"data sequence",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) {
         Bytes b = log_entry(g, 7, zeros(3 << 20), s, s);
         store_le32(b.data() + 8192 - 4, 8);  // the data sector's sequence_low
         vhdx::testing::fix_checksum(b);
         return b;
       },
       "data sector"},
      {"descriptor sequence",
       [](const vhdx::Guid& g, uint64_t, uint64_t s) {
         Bytes b = log_entry(g, 7, zeros(3 << 20), s, s);
         b[64 + 24] = std::byte{9};  // the descriptor's sequence number
         vhdx::testing::fix_checksum(b);
         return b;
       },
       "invalid descriptor"},
  };
  for (const Case& c : cases) {
    Editor w(slurp("i.vhdx"));
    const vhdx::Guid g = vhdx::random_guid();
    const int i = w.current_header_index();
    const uint64_t h = w.log_offset(i);
    w.write(h, c.entry(g, h, w.bytes().size()));
    w.set_log_guid(i, g);
    w.save((dir_ / "w.vhdx").string());
    auto d = open(slurp("w.vhdx"), true, nullptr, false, true);  // a write would fail the open with EXDEV
    ASSERT_FALSE(d) << c.name;
    EXPECT_EQ(d.status().code(), EINVAL) << c.name << ": " << d.status().message();
    EXPECT_NE(d.status().message().find(c.message), std::string::npos) << c.name << ": " << d.status().message();
  }
}

TEST_F(VhdxWrite, ALogWithABadChecksumIsNotReplayed) {
  make_base();
  edit("i.vhdx", [](Editor& e) {
    e.write_pending_log({{(e.bat(0) & vhdx::kBatOffsetMask) + 8192, pattern(4096, 0x77)}});
    e.write(e.log_offset(e.current_header_index()) + 4096 + 100, Bytes{static_cast<std::byte>('x')});
  });
  sh("qemu-img info i.vhdx >/dev/null");
  const Bytes img = slurp("i.vhdx");
  io::MemFile* f = nullptr;
  auto d = open(img, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_EQ(read(**d, 8192, 4096), pattern(4096, 0x11));  // as QEMU: no valid entry, nothing replayed
  ASSERT_TRUE(run((*d)->close()));
  EXPECT_TRUE(f->content() == img);
}

TEST_F(VhdxWrite, AValidPendingLogIsReplayedOnAWritableOpen) {
  make_base();
  edit("i.vhdx", [](Editor& e) {
    e.write_pending_log({{(e.bat(0) & vhdx::kBatOffsetMask) + 8192, pattern(4096, 0x77)},
                         {e.bat(9) & vhdx::kBatOffsetMask, pattern(4096, 0x78)}},
                        5);
  });
  const Bytes img = slurp("i.vhdx");
  EXPECT_EQ(open(img, false).status().code(), EPERM);
  const Bytes ours = our_replay(img);
  EXPECT_EQ(current_header(ours).log_guid, Bytes(16));
  EXPECT_EQ(current_header(ours).seq, current_header(img).seq + 4);
  spit("o.vhdx", ours);
  spit("q.vhdx", img);
  sh("qemu-img check -q -r all q.vhdx");
  const Bytes raw = qemu_raw("o.vhdx");
  EXPECT_TRUE(raw == qemu_raw("q.vhdx"));
  EXPECT_EQ(Bytes(raw.begin() + 8192, raw.begin() + 8192 + 4096), pattern(4096, 0x77));
  EXPECT_EQ(Bytes(raw.begin() + 9 * kMiB, raw.begin() + 9 * kMiB + 4096), pattern(4096, 0x78));
}

TEST_F(VhdxWrite, EntriesHoldAtMostWhatTheLogHolds) {
  EXPECT_EQ(vhdx::descriptor_sectors(1), 1u);
  EXPECT_EQ(vhdx::descriptor_sectors(126), 1u);
  EXPECT_EQ(vhdx::descriptor_sectors(127), 2u);
  const uint64_t n = vhdx::max_entry_sectors(kMiB);  // 256 sectors, one left free
  EXPECT_LE(vhdx::descriptor_sectors(n) + n, 255u);
  EXPECT_GT(vhdx::descriptor_sectors(n + 1) + n + 1, 255u);
}

// A fixed image whose blocks are FULLY_PRESENT. (qemu-img's default fixed
// image has them in state ZERO, with their space preallocated: QEMU 7.2, and
// we, give a written ZERO block a new block at the end of the file.)
TEST_F(VhdxWrite, FixedImagesWriteInPlace) {
  sh("qemu-img create -q -f vhdx -o subformat=fixed,block_size=1M,block_state_zero=off i.vhdx 16M");
  const Bytes base = slurp("i.vhdx");
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d);
  ASSERT_TRUE(run((*d)->write(5 * kMiB - 7, pattern(kMiB, 0x31))));
  ASSERT_TRUE(run((*d)->close()));
  EXPECT_EQ(f->content().size(), base.size());
  EXPECT_EQ(current_header(f->content()).seq, current_header(base).seq + 2);  // headers only, no log
  spit("c.vhdx", f->content());
  const Bytes raw = qemu_raw("c.vhdx");
  EXPECT_EQ(Bytes(raw.begin() + 5 * kMiB - 7, raw.begin() + 6 * kMiB - 7), pattern(kMiB, 0x31));
}

TEST_F(VhdxWrite, TruncateIsRefusedAsQemuCannotResizeVhdx) {
  make_base();
  auto d = open(slurp("i.vhdx"), true);
  ASSERT_TRUE(d);
  EXPECT_EQ(run((*d)->truncate(32 * kMiB)).code(), EINVAL);
  std::string out;
  EXPECT_NE(sh_rc("qemu-img resize -f vhdx i.vhdx 32M", &out), 0);
  EXPECT_EQ((*d)->size(), kDisk);
}

constexpr uint64_t kOffsetMask = ~uint64_t{0xFFFFF};

// A discard of whole blocks of a dynamic image: UNMAPPED entries (FileOffsetMB
// 0: the space is nobody's), the space punched; the cut blocks at either end
// and zeroing without unmap keep their FULLY_PRESENT entries.
TEST_F(VhdxWrite, DiscardedWholeBlocksBecomeUnmappedAndTheirSpaceIsPunched) {
  make_blocks();
  const Bytes base = slurp("i.vhdx");
  const std::vector<uint64_t> before = bat_of(base, {0, 1, 2, 3, 9});
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  const uint64_t allocated = f->allocated_bytes();
  ASSERT_TRUE(run((*d)->discard(kMiB - 4096, 2 * kMiB + 8192)));  // blocks 1 and 2 whole, 0 and 3 in part
  ASSERT_TRUE(run((*d)->write_zeroes(9 * kMiB, kMiB, false)));    // block 9 whole, no unmap
  EXPECT_TRUE(all_are(read(**d, kMiB - 4096, 2 * kMiB + 8192), 0));
  EXPECT_TRUE(all_are(read(**d, 9 * kMiB, kMiB), 0));
  EXPECT_TRUE(all_are(read(**d, 0, kMiB - 4096), 0x11));
  EXPECT_GE(allocated - f->allocated_bytes(), 2 * kMiB) << "the unmapped blocks' space was not punched";
  const Bytes ours = view(**d);
  ASSERT_TRUE(run((*d)->close()));
  const std::vector<uint64_t> after = bat_of(f->content(), {0, 1, 2, 3, 9});
  EXPECT_EQ(after[0], before[0]);
  EXPECT_EQ(after[1], uint64_t{vhdx::kUnmapped});
  EXPECT_EQ(after[2], uint64_t{vhdx::kUnmapped});
  EXPECT_EQ(after[3], before[3]);
  EXPECT_EQ(after[4], before[4]);  // zeroed in place
  EXPECT_EQ(after[4] & 7, uint64_t{vhdx::kFullyPresent});
  spit("c.vhdx", f->content());
  EXPECT_TRUE(qemu_raw("c.vhdx") == ours);
}

// A later allocation takes the space of a block unmapped and written back,
// zeroed again first: bytes a write racing with the discard left there do not
// show around the new data. Before the unmapped entry is written back, its
// space is not used (a crash must not leave two entries naming one block).
TEST_F(VhdxWrite, UnmappedSpaceIsReusedOnceWrittenBackAndReadsZerosAroundNewData) {
  make_blocks();
  const Bytes base = slurp("i.vhdx");
  const uint64_t x1 = bat_of(base, {1})[0] & kOffsetMask;
  const uint64_t x9 = bat_of(base, {9})[0] & kOffsetMask;
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  ASSERT_TRUE(run((*d)->discard(9 * kMiB, kMiB)));
  ASSERT_TRUE(run((*d)->discard(kMiB, kMiB)));
  ASSERT_TRUE(run((*d)->write(6 * kMiB, pattern(4096, 0x66))));  // not written back yet: the end of the file
  const uint64_t end = f->content().size();
  ASSERT_TRUE(run((*d)->flush()));
  ASSERT_TRUE(run(f->write(x9 + 12345, pattern(1000, 0x77))));  // stale bytes in the punched block
  ASSERT_TRUE(run((*d)->write(5 * kMiB + 4096, pattern(4096, 0x55))));
  ASSERT_TRUE(run((*d)->write(7 * kMiB, pattern(512, 0x57))));
  EXPECT_EQ(f->content().size(), end) << "the unmapped space was not reused";
  const Bytes block5 = read(**d, 5 * kMiB, kMiB);
  EXPECT_TRUE(all_are(std::span(block5).first(4096), 0));
  EXPECT_TRUE(all_are(std::span(block5).subspan(4096, 4096), 0x55));
  EXPECT_TRUE(all_are(std::span(block5).subspan(8192), 0)) << "stale bytes show in a reused block";
  const Bytes ours = view(**d);
  ASSERT_TRUE(run((*d)->close()));
  const std::vector<uint64_t> e = bat_of(f->content(), {1, 5, 6, 7, 9});
  EXPECT_EQ(e[0], uint64_t{vhdx::kUnmapped});
  EXPECT_EQ(e[4], uint64_t{vhdx::kUnmapped});
  EXPECT_GE(e[2] & kOffsetMask, end - kMiB) << "a block was put where an unmapped entry not yet written named";
  EXPECT_EQ(std::vector<uint64_t>({e[1] & kOffsetMask, e[3] & kOffsetMask}), std::vector<uint64_t>({x1, x9}));
  for (uint64_t entry : {e[1], e[2], e[3]}) EXPECT_EQ(entry & 7, uint64_t{vhdx::kFullyPresent});
  spit("c.vhdx", f->content());
  EXPECT_TRUE(qemu_raw("c.vhdx") == ours);
  // A remount does not reuse space (UNMAPPED entries name none): a write into
  // an unmapped block gets a new block at the end, as QEMU gives it one.
  auto again = open(f->content(), true, &f);
  ASSERT_TRUE(again);
  ASSERT_TRUE(run((*again)->write(9 * kMiB + 100, pattern(100, 0x99))));
  ASSERT_TRUE(run((*again)->close()));
  EXPECT_EQ(bat_of(f->content(), {9})[0], end | vhdx::kFullyPresent);
  spit("c2.vhdx", f->content());
  const Bytes raw = qemu_raw("c2.vhdx");
  EXPECT_TRUE(all_are(std::span(raw).subspan(9 * kMiB, 100), 0));
  EXPECT_TRUE(all_are(std::span(raw).subspan(9 * kMiB + 100, 100), 0x99));
}

// A read that looked block 9 up before the discard is still in flight (its
// host read held at a gate): the space is not reused until it completed.
TEST_F(VhdxWrite, SpaceIsNotReusedWhileAnIoThatFoundItIsInFlight) {
  make_blocks();
  const Bytes base = slurp("i.vhdx");
  const uint64_t x9 = bat_of(base, {9})[0] & kOffsetMask;
  io::MemFile mem(io::MemFileOptions{}, base);
  auto gated = std::make_unique<GatedReads>(mem);
  GatedReads* gate = gated.get();
  ImageOptions opts;
  opts.file.writable = true;
  auto d = run(open_vhdx(std::move(gated), (dir_ / "i.vhdx").string(), opts));
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_TRUE(all_are(read(**d, 9 * kMiB, 512), 0x33));  // the BAT slice is cached
  gate->arm(x9, x9 + kMiB);
  Bytes buf(4096);
  bool done = false;
  Status result;
  {
    io::ScopedEngine scope(engine_.get());
    spawn_then((*d)->read(9 * kMiB, buf), [&](Status st) {
      result = std::move(st);
      done = true;
    });
  }
  ASSERT_EQ(gate->waiting(), 1);
  ASSERT_TRUE(run((*d)->discard(9 * kMiB, kMiB)));
  ASSERT_TRUE(run((*d)->flush()));
  const uint64_t end = mem.size();
  ASSERT_TRUE(run((*d)->write(5 * kMiB, pattern(4096, 0x55))));
  EXPECT_EQ(mem.size(), end + kMiB) << "the space of block 9 was reused under a read that found it";
  gate->open_gate();
  {
    io::ScopedEngine scope(engine_.get());
    while (!done) engine_->run_once(100);
  }
  ASSERT_TRUE(result) << result.to_string();
  EXPECT_TRUE(all_are(buf, 0x33) || all_are(buf, 0));
  ASSERT_TRUE(run((*d)->write(6 * kMiB, pattern(4096, 0x66))));
  EXPECT_EQ(mem.size(), end + kMiB) << "the space of block 9 was not reused after the read";
  const Bytes ours = view(**d);
  ASSERT_TRUE(run((*d)->close()));
  const std::vector<uint64_t> e = bat_of(mem.content(), {5, 6, 9});
  EXPECT_EQ(e[0] & kOffsetMask, end);
  EXPECT_EQ(e[1], x9 | vhdx::kFullyPresent);
  EXPECT_EQ(e[2], uint64_t{vhdx::kUnmapped});
  spit("c.vhdx", mem.content());
  EXPECT_TRUE(qemu_raw("c.vhdx") == ours);
}

// A fixed image (LeaveBlocksAllocated) keeps every block FULLY_PRESENT where
// it was: discarded blocks are zeroed (punched) in place.
TEST_F(VhdxWrite, FixedImagesZeroDiscardedBlocksInPlace) {
  sh("qemu-img create -q -f vhdx -o subformat=fixed,block_size=1M,block_state_zero=off i.vhdx 16M && "
     "qemu-io -c 'write -P 0x44 0 16M' i.vhdx >/dev/null");
  const Bytes base = slurp("i.vhdx");
  const std::vector<uint64_t> before = bat_of(base, {1, 2, 3, 4});
  io::MemFile* f = nullptr;
  auto d = open(base, true, &f);
  ASSERT_TRUE(d) << d.status().to_string();
  const uint64_t allocated = f->allocated_bytes();
  ASSERT_TRUE(run((*d)->discard(2 * kMiB, 2 * kMiB)));
  EXPECT_TRUE(all_are(read(**d, 2 * kMiB, 2 * kMiB), 0));
  EXPECT_GE(allocated - f->allocated_bytes(), 2 * kMiB);
  ASSERT_TRUE(run((*d)->write(3 * kMiB, pattern(4096, 0x45))));  // in place again
  const Bytes ours = view(**d);
  ASSERT_TRUE(run((*d)->close()));
  EXPECT_EQ(f->content().size(), base.size());
  EXPECT_TRUE(bat_of(f->content(), {1, 2, 3, 4}) == before);
  spit("c.vhdx", f->content());
  EXPECT_TRUE(qemu_raw("c.vhdx") == ours);
}

// Discards, a write-back, writes into the freed space, another discard, and
// a fault at every host operation from the first discard on (the later
// operations still run, some fail): every image the host could hold opens
// writable (no two entries name one block), QEMU and we read it the same, and
// each block holds its old bytes, its new ones or zeros, nothing else.
TEST_F(VhdxWrite, DiscardAndReuseLeaveEveryCrashImageValid) {
  make_blocks();
  const Bytes base = slurp("i.vhdx");
  std::mt19937_64 rng(5);
  int faults = 0;
  for (uint64_t k = 1; k < 200 && !HasFailure(); k += 3 * io::testing::kSanitizerScale) {
    io::MemFile* f = nullptr;
    auto d = open(base, true, &f, true);
    ASSERT_TRUE(d);
    ASSERT_TRUE(run((*d)->write(5 * kMiB, pattern(8192, 0x21))));  // flushed: must survive
    ASSERT_TRUE(run((*d)->flush()));
    const uint64_t ops = f->counters().total();
    f->fail_nth(io::OpKind::any, k, EIO);
    (void)run((*d)->discard(9 * kMiB, kMiB));
    (void)run((*d)->discard(kMiB, kMiB));
    (void)run((*d)->flush());
    (void)run((*d)->write(6 * kMiB + 512, pattern(4096, 0x22)));
    (void)run((*d)->write(7 * kMiB, pattern(4096, 0x23)));
    (void)run((*d)->discard(0, kMiB));
    (void)run((*d)->write(2 * kMiB + 4096, pattern(4096, 0x24)));
    (void)run((*d)->flush());
    if (f->counters().total() - ops < k) break;  // the fault never fired: every step had its turn
    ++faults;
    for (const Bytes& image : {f->content(), f->crash_image(rng())}) {
      const std::string at = "fault at operation " + std::to_string(k);
      const Bytes ours = our_replay(image);
      auto ro = open(ours, false);
      ASSERT_TRUE(ro) << at << ": " << ro.status().to_string();
      EXPECT_TRUE(all_are(read(**ro, 5 * kMiB, 8192), 0x21)) << at;
      const Bytes disk = view(**ro);
      auto holds = [&](uint64_t off, uint64_t len, std::initializer_list<uint8_t> allowed) {
        const auto part = std::span(disk).subspan(off, len);
        for (uint8_t v : allowed)
          if (all_are(part, v)) return true;
        return false;
      };
      EXPECT_TRUE(holds(9 * kMiB, kMiB, {0x33, 0})) << at;
      EXPECT_TRUE(holds(kMiB, kMiB, {0x11, 0})) << at;
      EXPECT_TRUE(holds(0, kMiB, {0x11, 0})) << at;
      EXPECT_TRUE(holds(6 * kMiB + 512, 4096, {0x22, 0})) << at;
      EXPECT_TRUE(holds(7 * kMiB, 4096, {0x23, 0})) << at;
      EXPECT_TRUE(holds(6 * kMiB + 512 + 4096, kMiB - 512 - 4096, {0})) << at;
      EXPECT_TRUE(holds(2 * kMiB + 4096, 4096, {0x24, 0x11})) << at;
      spit("ours.vhdx", ours);
      spit("theirs.vhdx", image);
      sh("qemu-img check -q -r all theirs.vhdx");
      const Bytes ours_raw = qemu_raw("ours.vhdx");  // checked and converted once, compared twice
      EXPECT_TRUE(ours_raw == qemu_raw("theirs.vhdx")) << at;
      EXPECT_TRUE(ours_raw == disk) << at;
    }
  }
  EXPECT_GE(faults, 10 / io::testing::kSanitizerScale);
}

}  // namespace
}  // namespace qcowfs::image
