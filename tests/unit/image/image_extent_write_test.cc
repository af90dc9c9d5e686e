// ExtentDriver's write path with each format's ExtentWriter (VDI dynamic and
// static, Parallels, QED, fixed VHD): writes into new and allocated units, partial units,
// zeroing, one host write per contiguous run, and crash consistency. Workloads run over a
// MemFile that tracks unflushed host writes; at every flush boundary and at
// random points between, power-loss images (unflushed writes dropped and
// reordered) must pass `qemu-img check` and hold every byte acknowledged
// before the last completed flush, read back by qemu-img.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <sstream>

#include "image/parallels/parallels.h"
#include "image/qed/qed.h"
#include "image/vdi/vdi.h"
#include "image/vhdx/vhdx.h"
#include "image/vmdk/vmdk.h"
#include "image/vpc/vpc.h"
#include <chrono>

#include "unit/image/forwarding_file.h"
#include "io/mem_file.h"
#include "io/when_all.h"
#include "unit/qcow2/qcow2_write_test_util.h"

namespace qcowfs::image {
namespace {

using qcow2::testing::read_file;
using qcow2::testing::shell;
using qcow2::testing::write_file;

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kDisk = 8 * kMiB + 3 * 512;  // the last block is used in part
constexpr uint64_t kSector = 512;               // granularity of the "touched since the last flush" map

struct Model {
  std::vector<std::byte> now = std::vector<std::byte>(kDisk);      // what reads return
  std::vector<std::byte> durable = std::vector<std::byte>(kDisk);  // as of the last completed flush
  std::vector<bool> touched = std::vector<bool>((kDisk + kSector - 1) / kSector);
  void change(uint64_t off, uint64_t len) {
    for (uint64_t b = off / kSector; b <= (off + len - 1) / kSector; ++b) touched[b] = true;
  }
  void flushed() {
    durable = now;
    std::fill(touched.begin(), touched.end(), false);
  }
};

struct Variant {
  const char* name;
  const char* format;  // qemu-img's
  const char* create_opts;
};

// What `qemu-img check` may say of a crash image: leaks (Parallels prints its
// leak at the end of the file as an "ERROR" line, counted as a leak), and for
// Parallels the `inuse` flag ("image was not closed correctly"; -r all clears
// it), which every image open read-write has on disk, by QEMU's design.
// A HostFile whose data writes (64 KiB or more) wait until `hold` of them
// are in flight, or until release(): shows how many allocating writes reach
// the host at once. The `fail`-th data write (from 1; 0: none) fails with EIO
// and writes nothing.
class HeldDataWrites final : public qcowfs::testing::ForwardingFile {
 public:
  static constexpr size_t kData = 64 * 1024;
  HeldDataWrites(std::unique_ptr<io::HostFile> f, int hold, int fail)
      : ForwardingFile(std::move(f)), hold_(hold), fail_(fail) {}
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override {
    if (buf.size() >= kData) {
      const bool ok = co_await held();  // not inside a condition: GCC 12 miscompiles that
      if (!ok) co_return Status::error(EIO, "injected data write failure");
    }
    co_return co_await inner().write(off, buf);
  }
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override {
    size_t n = 0;
    for (const iovec& v : iov) n += v.iov_len;
    if (n >= kData) {
      const bool ok = co_await held();
      if (!ok) co_return Status::error(EIO, "injected data write failure");
    }
    co_return co_await inner().writev(off, iov);
  }
  void release() { gate_.set(); }
  bool released() { return gate_.is_set(); }
  int max_in_flight() const { return max_in_flight_; }
  int data_writes() const { return seen_; }

 private:
  // Waits for the gate; false for the write that fails.
  Task<bool> held() {
    const int mine = ++seen_;
    max_in_flight_ = std::max(max_in_flight_, ++in_flight_);
    if (in_flight_ >= hold_) gate_.set();
    co_await gate_.wait();
    --in_flight_;
    co_return mine != fail_;
  }
  int hold_;
  int fail_;
  io::AsyncEvent gate_;
  int in_flight_ = 0;  // touched only on the test's engine thread
  int max_in_flight_ = 0;
  int seen_ = 0;
};

bool only_allowed_findings(const std::string& format, const std::string& out) {
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("ERROR", 0) != 0) continue;
    if (format == "parallels" && line == "ERROR image was not closed correctly") continue;
    if (format == "parallels" && line.rfind("ERROR space leaked at the end of the image", 0) == 0) continue;
    return false;
  }
  return true;
}

class ExtentWrite : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    engine_ = std::move(*io::make_engine(io::EngineKind::threads));
    format_ = GetParam().format;
    path_ = fmt::format("/var/tmp/qcowfs-extent-write-{}-{}.img", ::getpid(), GetParam().name);
    std::string out;
    const std::string opts = *GetParam().create_opts ? fmt::format("-o {}", GetParam().create_opts) : "";
    ASSERT_EQ(shell(fmt::format("qemu-img create -q -f {} {} {} {}", format_, opts, path_, kDisk), &out), 0) << out;
  }
  void TearDown() override { ::unlink(path_.c_str()); }
  template <typename T>
  T run(Task<T> t) {
    return io::run_sync(*engine_, std::move(t));
  }

  // One line per format.
  Task<Result<std::unique_ptr<BlockDriver>>> open_format(std::unique_ptr<io::HostFile> mem, const ImageOptions& o) {
    if (format_ == "vdi") return open_vdi(std::move(mem), path_, o);
    if (format_ == "qed") return open_qed(std::move(mem), path_, o);
    if (format_ == "vpc") return open_vpc(std::move(mem), path_, o);
    if (format_ == "vmdk") return open_vmdk(std::move(mem), path_, o);
    if (format_ == "vhdx") return open_vhdx(std::move(mem), path_, o);
    return open_parallels(std::move(mem), path_, o);
  }

  // A writable driver over a MemFile holding the image (seen through
  // `held` when given: the MemFile is then its inner file).
  std::unique_ptr<BlockDriver> open(io::MemFile** file_out, HeldDataWrites** held = nullptr, int hold = 0,
                                    int fail = 0) {
    io::MemFileOptions mo;
    mo.track_unflushed = true;
    auto mem = std::make_unique<io::MemFile>(mo, read_file(path_));
    *file_out = mem.get();
    std::unique_ptr<io::HostFile> file = std::move(mem);
    if (held != nullptr) {
      auto h = std::make_unique<HeldDataWrites>(std::move(file), hold, fail);
      *held = h.get();
      file = std::move(h);
    }
    ImageOptions o;
    o.file.writable = true;
    auto d = run(open_format(std::move(file), o));
    EXPECT_TRUE(d) << d.status().to_string();
    return d ? std::move(*d) : nullptr;
  }

  bool checkable() const { return format_ != "vpc"; }
  // Every unit is data from the start (nothing is ever allocated). Not so a
  // fixed VHDX as qemu-img makes it: its blocks are ZERO until written, and a
  // write into one goes through the allocating path.
  bool all_in_place() const {
    const std::string name = GetParam().name;
    return name == "vdi_static" || name == "vpc_fixed";
  }

  // VHDX: QEMU refuses a read-only open of an image whose log needs replay.
  // The image after our replay (a writable open and close), whose bytes must
  // be those QEMU reads after its own replay (qemu-img check -r all).
  std::vector<std::byte> vhdx_replayed(const std::vector<std::byte>& image, const std::string& where) {
    auto mem = std::make_unique<io::MemFile>(io::MemFileOptions{}, image);
    io::MemFile* file = mem.get();
    ImageOptions o;
    o.file.writable = true;
    auto d = run(open_format(std::move(mem), o));
    EXPECT_TRUE(d) << where << ": " << d.status().to_string();
    if (!d) return image;
    EXPECT_TRUE(run((*d)->close())) << where;
    std::vector<std::byte> ours = file->content();
    if (ours == image) return ours;  // nothing to replay (a crash inside a BAT update: vhdx_write_test.cc)
    const std::string theirs = path_ + ".qemu-replay", mine = path_ + ".our-replay";
    write_file(theirs, image);
    write_file(mine, ours);
    std::string out;
    EXPECT_EQ(shell(fmt::format("qemu-img check -q -r all -f vhdx {}", theirs), &out), 0) << where << ":\n" << out;
    for (const std::string& f : {theirs, mine})
      EXPECT_EQ(shell(fmt::format("qemu-img convert -f vhdx -O raw {0} {0}.raw", f), &out), 0) << where << out;
    EXPECT_TRUE(read_file(theirs + ".raw") == read_file(mine + ".raw")) << where << ": QEMU's replay reads otherwise";
    for (const std::string& f : {theirs, mine, theirs + ".raw", mine + ".raw"}) ::unlink(f.c_str());
    return ours;
  }

  // qemu-img check and the bytes qemu-img reads of image: a crash image may
  // have leaks and what only_allowed_findings() allows; a closed one nothing.
  std::vector<std::byte> qemu_view(const std::vector<std::byte>& image, const std::string& where, bool closed) {
    const std::string path = path_ + ".crash", raw = path + ".raw";
    write_file(path, format_ == "vhdx" ? vhdx_replayed(image, where) : image);
    std::string out;
    // qemu-img check has no check for vpc ("does not support checks"); the bytes are still compared.
    const int rc = !checkable() ? 0 : shell(fmt::format("qemu-img check -U -f {} {}", format_, path), &out);
    if (closed) {
      EXPECT_EQ(rc, 0) << where << ":\n" << out;
    } else {
      EXPECT_TRUE(only_allowed_findings(format_, out)) << where << ":\n" << out;
    }
    EXPECT_EQ(shell(fmt::format("qemu-img convert -U -f {} -O raw {} {}", format_, path, raw), &out), 0)
        << where << out;
    auto got = read_file(raw);
    ::unlink(path.c_str());
    ::unlink(raw.c_str());
    return got;
  }

  void check_crash(const std::vector<std::byte>& image, const Model& m, const std::string& where, bool closed = false) {
    auto got = qemu_view(image, where, closed);
    ASSERT_EQ(got.size(), kDisk) << where;
    for (uint64_t b = 0; b < m.touched.size(); ++b) {
      if (m.touched[b]) continue;
      const uint64_t n = std::min(kSector, kDisk - b * kSector);
      if (std::memcmp(got.data() + b * kSector, m.durable.data() + b * kSector, n) != 0) {
        ADD_FAILURE() << where << ": flushed data lost at guest offset " << b * kSector;
        return;
      }
    }
  }

  void concurrent_writes(int fail);

  std::unique_ptr<io::Engine> engine_;
  std::string format_;
  std::string path_;
};

TEST_P(ExtentWrite, WritesZeroesAndReadsBackAsQemuReadsThem) {
  io::MemFile* file = nullptr;
  auto d = open(&file);
  ASSERT_TRUE(d);
  EXPECT_FALSE(d->read_only());
  Model m;
  std::mt19937_64 rng(7);
  auto write = [&](uint64_t off, uint64_t len) {
    std::vector<std::byte> data(len);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    ASSERT_TRUE(run(d->write(off, data)));
    std::memcpy(m.now.data() + off, data.data(), len);
  };
  write(4096, 4096);          // the middle of a new block
  write(kMiB - 100, 300);     // across two new blocks, unaligned
  write(2 * kMiB, 2 * kMiB);  // two whole blocks
  write(4096 + 512, 777);     // into an allocated block
  write(kDisk - 1000, 1000);  // the partly used last block
  ASSERT_TRUE(run(d->write_zeroes(2 * kMiB + 100, kMiB, true)));
  std::memset(m.now.data() + 2 * kMiB + 100, 0, kMiB);
  ASSERT_TRUE(run(d->write_zeroes(6 * kMiB, kMiB, false)));  // unallocated: stays so
  std::vector<std::byte> back(kDisk);
  ASSERT_TRUE(run(d->read(0, back)));
  EXPECT_TRUE(back == m.now);
  ASSERT_TRUE(run(d->close()));
  EXPECT_TRUE(qemu_view(file->content(), "after close", true) == m.now);
}

// QED grows (qemu-img resize does), never shrinks; VDI and Parallels cannot
// be resized at all (EINVAL, as qemu-img resize refuses them).
TEST_P(ExtentWrite, ResizesAsQemuImgResizes) {
  io::MemFile* file = nullptr;
  auto d = open(&file);
  ASSERT_TRUE(d);
  EXPECT_EQ(run(d->truncate(kDisk - kMiB)).code(), EINVAL);
  if (format_ != "qed") {
    EXPECT_EQ(run(d->truncate(kDisk + kMiB)).code(), EINVAL);
    EXPECT_EQ(d->size(), kDisk);
    ASSERT_TRUE(run(d->close()));
    return;
  }
  EXPECT_EQ(run(d->truncate(kDisk + 100)).code(), EINVAL);  // not whole sectors
  const uint64_t grown = kDisk + 64 * kMiB;
  ASSERT_TRUE(run(d->truncate(grown)));
  EXPECT_EQ(d->size(), grown);
  std::vector<std::byte> data(8192, std::byte{0x33});
  ASSERT_TRUE(run(d->write(grown - 4096, std::span(data).first(4096))));
  std::vector<std::byte> back(8192);
  ASSERT_TRUE(run(d->read(grown - 8192, back)));
  EXPECT_TRUE(std::all_of(back.begin(), back.begin() + 4096, [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(std::equal(back.begin() + 4096, back.end(), data.begin()));
  ASSERT_TRUE(run(d->close()));
  const std::string path = path_ + ".grown", raw = path + ".raw";
  write_file(path, file->content());
  std::string out;
  EXPECT_EQ(shell(fmt::format("qemu-img check -f qed {}", path), &out), 0) << out;
  ASSERT_EQ(shell(fmt::format("qemu-img convert -f qed -O raw {} {}", path, raw), &out), 0) << out;
  auto got = read_file(raw);
  ASSERT_EQ(got.size(), grown);
  EXPECT_TRUE(std::equal(data.begin(), data.begin() + 4096, got.end() - 4096));
  ::unlink(path.c_str());
  ::unlink(raw.c_str());
}

TEST_P(ExtentWrite, ARequestOverNewBlocksIsOneHostWrite) {
  io::MemFile* file = nullptr;
  auto d = open(&file);
  ASSERT_TRUE(d);
  std::vector<std::byte> data(3 * kMiB + 4096, std::byte{0x5a});
  // The first allocation sets the format's dirty flag and creates its first
  // second-level table (QED): host writes of their own.
  ASSERT_TRUE(run(d->write(6 * kMiB, std::span(data).first(512))));
  const uint64_t writes_before = file->counters().writes;
  ASSERT_TRUE(run(d->write(kMiB - 4096, data)));
  // Four new units (or, static VDI, in place): one host write. A dynamic
  // VHD's new 2 MiB blocks each begin with a bitmap; the zeros between the
  // first one and the request are left out (fresh space), so that bitmap is a
  // host write of its own.
  EXPECT_EQ(file->counters().writes - writes_before, GetParam().name == std::string("vpc_dynamic") ? 2u : 1u);
  ASSERT_TRUE(run(d->close()));
}

// Four writes into new units at once (A to D), E over A's data and F after
// it, 512 KiB into the image: A to D reach the host together; E waits for A
// to publish, then writes over it; F goes to the host at once, into the
// space A reserved where A's unit holds it (the unit is 1 MiB or more: F
// rides A), else into a new unit of its own. G (4 KiB, not held) lies just
// before C's data, in the head C leaves out: it rides C (with a VHD, whose
// blocks begin with a bitmap, too), or allocates a 4 KiB cluster. With `fail` = 1, A's data write
// fails: B to D (and F, reserved after them or riding A) are given back and
// written again, E then allocates A's units itself, and the image is
// consistent. The bytes QEMU reads afterwards are the model's.
void ExtentWrite::concurrent_writes(int fail) {
  io::MemFile* file = nullptr;
  HeldDataWrites* held = nullptr;
  auto d = open(&file, &held, 5, fail);
  ASSERT_TRUE(d);
  struct W {
    uint64_t off, len;
  };
  const std::array<W, 7> ws = {W{0, 256 * 1024},  W{2 * kMiB, 256 * 1024},  W{4 * kMiB + 4096, 300 * 1024},
                               W{6 * kMiB, kMiB},  W{64 * 1024, 64 * 1024},  W{512 * 1024, 64 * 1024},
                               W{4 * kMiB, 4096}};
  std::vector<std::vector<std::byte>> data;
  for (size_t i = 0; i < ws.size(); ++i) data.emplace_back(ws[i].len, static_cast<std::byte>(0x31 + i));
  std::array<Status, 7> results;
  std::vector<Task<Status>> tasks;
  for (size_t i = 0; i < ws.size(); ++i)
    tasks.push_back([](BlockDriver& drv, W w, std::span<const std::byte> src, Status& out) -> Task<Status> {
      out = co_await drv.write(w.off, src);
      co_return Status::ok();
    }(*d, ws[i], data[i], results[i]));
  // Lets the writes go after 2 s should they never be four at the host (the
  // lock held across data writes): the test then fails instead of hanging.
  tasks.push_back([](HeldDataWrites& h) -> Task<Status> {
    for (int i = 0; i < 200 && !h.released(); ++i) co_await io::sleep_for(std::chrono::milliseconds(10));
    h.release();
    co_return Status::ok();
  }(*held));
  ASSERT_TRUE(run(io::when_all(std::move(tasks))));
  EXPECT_GE(held->max_in_flight(), 5) << "allocating writes did not reach the host together";
  // A to F once each; after A's failure, B to D and F once more where they
  // allocated (F either rode A, or allocated after D); and where G rode C,
  // G again, before C: C's space given back is no longer fresh, so G writes
  // its whole unit (zeros around it), which counts.
  if (fail == 1 && !all_in_place()) {
    EXPECT_TRUE(held->data_writes() == 10 || held->data_writes() == 11) << held->data_writes();
  } else {
    EXPECT_EQ(held->data_writes(), 6);
  }
  Model m;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (fail == 1 && i == 0) {
      EXPECT_EQ(results[i].code(), EIO) << results[i].to_string();
      continue;
    }
    EXPECT_TRUE(results[i]) << "write " << i << ": " << results[i].to_string();
    std::memcpy(m.now.data() + ws[i].off, data[i].data(), ws[i].len);
  }
  std::vector<std::byte> got(kDisk);
  ASSERT_TRUE(run(d->read(0, got)));
  // Where every unit is allocated, A and E are two writes in flight at once
  // over the same bytes: either may land last.
  const std::span<const std::byte> e_range(got.data() + ws[4].off, ws[4].len);
  if (all_in_place() && fail == 0 && e_range[0] == data[0][0]) {
    EXPECT_TRUE(std::equal(e_range.begin(), e_range.end(), data[0].begin() + ws[4].off));
    std::memcpy(m.now.data() + ws[4].off, data[0].data() + ws[4].off, ws[4].len);
  }
  EXPECT_TRUE(got == m.now) << "the view differs from what the writes left";
  ASSERT_TRUE(run(d->close()));
  m.flushed();
  // A failure may leak the space of a run something was placed after (a QED L2 table).
  check_crash(file->content(), m, "after close", fail == 0);
}

// A flush while two allocating writes are at the host waits for them to be
// published, and writes back nothing that counts their space before: the
// image as of the flush passes QEMU's check and holds both writes.
TEST_P(ExtentWrite, AFlushWaitsForTheAllocationsInFlight) {
  io::MemFile* file = nullptr;
  HeldDataWrites* held = nullptr;
  auto d = open(&file, &held, 3, 0);  // never three: released below
  ASSERT_TRUE(d);
  const std::vector<std::byte> a(kMiB, std::byte{0x61}), b(256 * 1024, std::byte{0x62});
  int done = 0, flushed_after = -1;
  std::vector<Task<Status>> tasks;
  auto write = [](BlockDriver& drv, uint64_t off, std::span<const std::byte> src, int& n) -> Task<Status> {
    QCOWFS_CO_TRY(co_await drv.write(off, src));
    ++n;
    co_return Status::ok();
  };
  tasks.push_back(write(*d, 0, a, done));
  tasks.push_back(write(*d, 3 * kMiB + 4096, b, done));
  tasks.push_back([](BlockDriver& drv, int& n, int& after) -> Task<Status> {
    QCOWFS_CO_TRY(co_await drv.flush());
    after = n;
    co_return Status::ok();
  }(*d, done, flushed_after));
  tasks.push_back([](HeldDataWrites& h) -> Task<Status> {
    co_await io::sleep_for(std::chrono::milliseconds(50));  // the flush is waiting by now
    h.release();
    co_return Status::ok();
  }(*held));
  ASSERT_TRUE(run(io::when_all(std::move(tasks))));
  EXPECT_EQ(held->max_in_flight(), 2);
  Model m;
  std::memcpy(m.now.data(), a.data(), a.size());
  std::memcpy(m.now.data() + 3 * kMiB + 4096, b.data(), b.size());
  if (all_in_place()) {
    // Writes in place hold nothing up: the flush went first, and owes them nothing.
    EXPECT_EQ(flushed_after, 0);
    m.change(0, a.size());
    m.change(3 * kMiB + 4096, b.size());
  } else {
    EXPECT_EQ(flushed_after, 2) << "the flush completed before the allocations in flight";
    m.flushed();
  }
  check_crash(file->durable_content(), m, "as of the flush");
  m.flushed();
  ASSERT_TRUE(run(d->close()));
  check_crash(file->content(), m, "after close", true);
}

TEST_P(ExtentWrite, AllocatingWritesReachTheHostTogether) { concurrent_writes(0); }

TEST_P(ExtentWrite, AFailedAllocationAmongOthersIsGivenBackWithTheLaterOnes) { concurrent_writes(1); }

TEST_P(ExtentWrite, EveryCutPointLeavesAValidImageWithFlushedDataIntact) {
  io::MemFile* file = nullptr;
  auto d = open(&file);
  ASSERT_TRUE(d);
  std::mt19937_64 rng(std::hash<std::string>{}(GetParam().name) & 0xffff);
  Model m;
  int checks = 0;
  for (int step = 0; step < 120 / io::testing::kSanitizerScale && !::testing::Test::HasFailure(); ++step) {
    const uint64_t r = rng() % 100;
    const uint64_t off = rng() % kDisk;
    const uint64_t len = std::min<uint64_t>(kDisk - off, 1 + rng() % (r < 50 ? 200000 : 1500000));
    if (r < 65) {
      std::vector<std::byte> data(len);
      for (auto& b : data) b = static_cast<std::byte>(rng());
      ASSERT_TRUE(run(d->write(off, data)));
      std::memcpy(m.now.data() + off, data.data(), len);
      m.change(off, len);
    } else if (r < 80) {
      ASSERT_TRUE(run(d->write_zeroes(off, len, rng() % 2 == 0)));
      std::memset(m.now.data() + off, 0, len);
      m.change(off, len);
    } else {
      ASSERT_TRUE(run(d->flush()));
      m.flushed();
      check_crash(file->crash_image(rng()), m, fmt::format("after flush at step {}", step));
      ++checks;
      continue;
    }
    if (step % 7 == 0) {
      check_crash(file->crash_image(rng()), m, fmt::format("between flushes at step {}", step));
      ++checks;
    }
  }
  ASSERT_TRUE(run(d->close()));
  m.flushed();
  check_crash(file->content(), m, "after close", true);
  EXPECT_GE(checks, 20 / io::testing::kSanitizerScale);
}

INSTANTIATE_TEST_SUITE_P(Images, ExtentWrite,
                         ::testing::Values(                                                     // one line per variant
                             Variant{"vdi_dynamic", "vdi", ""},                                 //
                             Variant{"vdi_static", "vdi", "static=on"},                         //
                             Variant{"parallels", "parallels", ""},                             //
                             Variant{"parallels_4k", "parallels", "cluster_size=4096"},         //
                             Variant{"qed", "qed", ""},                                         //
                             Variant{"qed_4k", "qed", "cluster_size=4096"},                     //
                             Variant{"vmdk_sparse", "vmdk", ""},                                //
                             Variant{"vmdk_sparse_zeroed_grain", "vmdk", "zeroed_grain=on"},    //
                             Variant{"vpc_fixed", "vpc", "subformat=fixed,force_size=on"},      //
                             Variant{"vpc_dynamic", "vpc", "subformat=dynamic,force_size=on"},  //
                             Variant{"vhdx_dynamic", "vhdx", "block_size=1M"},                  //
                             Variant{"vhdx_fixed", "vhdx", "subformat=fixed,block_size=1M"}),
                         [](const ::testing::TestParamInfo<Variant>& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace qcowfs::image
