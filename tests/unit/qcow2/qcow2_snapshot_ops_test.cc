// Internal snapshot operations (image/qcow2/snapshot_ops.h) on a qcow2 image
// built in memory: the refcount walk of create and delete (every cluster the
// active tables reach counted once more, then once less; OFLAG_COPIED
// cleared and set again), the image consistent for qcowfs check after each
// step, the snapshot's bytes readable through the driver, freed clusters
// discarded; and the snapshot table written as QEMU writes it.
#include <gtest/gtest.h>

#include "image/endian.h"
#include "image/qcow2/qcow2.h"
#include "image/qcow2/qcow2_check.h"
#include "image/qcow2/qcow2_create.h"
#include "image/qcow2/qcow2_inspect.h"
#include "image/qcow2/snapshot_ops.h"
#include "image/qcow2/snapshot_refcount.h"
#include "io/forwarding_file.h"
#include "io/mem_file.h"
#include "io/run_sync.h"

namespace qcowfs::image::qcow2 {
namespace {

constexpr uint64_t kCs = 65536;
constexpr uint64_t kDisk = 4 << 20;

class Qcow2SnapshotOps : public ::testing::Test {
 protected:
  template <typename T>
  auto run(Task<T> t) {
    return io::run_sync(*engine_, std::move(t));
  }

  void SetUp() override {
    auto e = io::make_engine(io::EngineKind::threads, 8);
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
    CreateOptions o;
    o.size = kDisk;
    o.size_given = true;
    ASSERT_TRUE(run(write_new_image(mem_, nullptr, o)));
    write(0, 2 * kCs, std::byte{0x11});
    write(2 << 20, kCs, std::byte{0x22});
  }

  std::unique_ptr<BlockDriver> open(bool writable, const std::string& snapshot = "") {
    return open_file(mem_, writable, snapshot);
  }

  std::unique_ptr<BlockDriver> open_file(io::HostFile& file, bool writable, const std::string& snapshot) {
    ImageOptions o;
    o.file.writable = writable;
    o.file.locking = io::LockMode::off;
    o.snapshot = snapshot;
    auto d = run(open_qcow2(std::make_unique<io::ForwardingFile>(file), "mem", o));
    EXPECT_TRUE(d) << d.status().to_string();
    return d ? std::move(*d) : nullptr;
  }

  void write(uint64_t off, uint64_t len, std::byte v) {
    auto d = open(true);
    ASSERT_TRUE(d);
    std::vector<std::byte> buf(len, v);
    ASSERT_TRUE(run(d->write(off, buf)));
    ASSERT_TRUE(run(d->close()));
  }

  std::byte first_byte(const std::string& snapshot, uint64_t off) { return byte_at(mem_, snapshot, off); }

  std::byte byte_at(io::HostFile& file, const std::string& snapshot, uint64_t off) {
    auto d = open_file(file, false, snapshot);
    if (!d) return std::byte{0xee};
    std::vector<std::byte> buf(512);
    EXPECT_TRUE(run(d->read(off, buf)));
    EXPECT_TRUE(run(d->close()));
    return buf[0];
  }

  std::unique_ptr<SnapshotImage> load() {
    auto im = run(load_snapshot_image(mem_));
    EXPECT_TRUE(im) << im.status().to_string();
    return im ? std::move(*im) : nullptr;
  }

  void expect_clean() {
    auto r = run(check_image(mem_, {}));
    ASSERT_TRUE(r) << r.status().to_string();
    std::string messages;
    for (const auto& m : r->messages) messages += m + "\n";
    EXPECT_EQ(r->corruptions, 0u) << messages;
    EXPECT_EQ(r->leaks, 0u) << messages;
    EXPECT_EQ(r->check_errors, 0u) << messages;
  }

  // Refcount and COPIED flag of the L2 table of L1 entry 0 and of the data
  // cluster of guest cluster gc, as stored.
  struct Mapped {
    uint64_t l2_refcount = 0, data_refcount = 0;
    bool l2_copied = false, data_copied = false;
  };
  Mapped mapped(uint64_t gc) {
    auto im = load();
    Mapped m;
    const uint64_t l2 = im->l1[0] & kL1OffsetMask;
    m.l2_copied = (im->l1[0] & kOflagCopied) != 0;
    m.l2_refcount = *run(im->refcounts->get(l2 / kCs));
    std::vector<std::byte> table(kCs);
    EXPECT_TRUE(*run(mem_.read(l2, table)) == kCs);
    const uint64_t entry = load_be64(table.data() + gc * kL2EntrySize);
    m.data_copied = (entry & kOflagCopied) != 0;
    m.data_refcount = *run(im->refcounts->get((entry & kL2OffsetMask) / kCs));
    return m;
  }

  std::unique_ptr<io::Engine> engine_;
  io::MemFile mem_;
};

TEST_F(Qcow2SnapshotOps, CreateCountsEveryClusterOnceMoreAndDeleteOnceLess) {
  Mapped before = mapped(0);
  EXPECT_EQ(before.l2_refcount, 1u);
  EXPECT_EQ(before.data_refcount, 1u);
  EXPECT_TRUE(before.l2_copied && before.data_copied);

  auto im = load();
  auto sn = run(create_snapshot(*im, NewSnapshot{"first", 1700000000, 5000}));
  ASSERT_TRUE(sn) << sn.status().to_string();
  EXPECT_EQ(sn->id, "1");
  expect_clean();
  Mapped shared = mapped(0);
  EXPECT_EQ(shared.l2_refcount, 2u);
  EXPECT_EQ(shared.data_refcount, 2u);
  EXPECT_FALSE(shared.l2_copied || shared.data_copied);

  // A write now copies the cluster: the snapshot keeps the old bytes.
  write(0, kCs, std::byte{0x33});
  EXPECT_EQ(first_byte("", 0), std::byte{0x33});
  EXPECT_EQ(first_byte("first", 0), std::byte{0x11});
  EXPECT_EQ(first_byte("first", 2 << 20), std::byte{0x22});
  expect_clean();

  im = load();
  ASSERT_EQ(im->snapshots.size(), 1u);
  EXPECT_EQ(im->snapshots[0].disk_size, kDisk);
  EXPECT_EQ(im->snapshots[0].icount, 0u);
  const uint64_t discards = mem_.counters().discards;
  ASSERT_TRUE(run(delete_snapshot(*im, "1", "first")));
  expect_clean();
  EXPECT_GT(mem_.counters().discards, discards);  // the snapshot's own copy of cluster 0 was freed
  Mapped after = mapped(1);
  EXPECT_EQ(after.l2_refcount, 1u);
  EXPECT_EQ(after.data_refcount, 1u);
  EXPECT_TRUE(after.l2_copied && after.data_copied);
  EXPECT_TRUE(load()->snapshots.empty());
}

TEST_F(Qcow2SnapshotOps, ApplyRestoresTheBytesAndIdsFollowQemu) {
  auto im = load();
  ASSERT_TRUE(run(create_snapshot(*im, NewSnapshot{"a", 1, 0})));
  write(0, kCs, std::byte{0x44});
  im = load();
  auto b = run(create_snapshot(*im, NewSnapshot{"a", 2, 0}));  // same name: allowed, new ID
  ASSERT_TRUE(b);
  EXPECT_EQ(b->id, "2");
  ASSERT_TRUE(run(apply_snapshot(*im, "1")));
  expect_clean();
  EXPECT_EQ(first_byte("", 0), std::byte{0x11});
  ASSERT_TRUE(run(apply_snapshot(*im, "a")));  // "a" is no ID: the first named a
  EXPECT_EQ(first_byte("", 0), std::byte{0x11});
  EXPECT_EQ(run(apply_snapshot(*im, "zz")).code(), ENOENT);
  EXPECT_EQ(run(delete_snapshot(*im, "2", "b")).code(), ENOENT);
  ASSERT_TRUE(run(delete_snapshot(*im, "1", "a")));
  ASSERT_TRUE(run(create_snapshot(*im, NewSnapshot{"c", 3, 0})));
  EXPECT_EQ(load()->snapshots.back().id, "3");
  ASSERT_TRUE(run(apply_snapshot(*im, "2")));
  EXPECT_EQ(first_byte("", 0), std::byte{0x44});
  expect_clean();
}

// Power loss at every flush of create, apply and delete (the op fails at
// flush number `cut`; unflushed writes are dropped or kept at random): the
// image must hold each snapshot whole or not at all, read the active disk as
// before or after, and have nothing worse than leaks and OFLAG_COPIED
// mismatches (which point no data at a freed or shared-and-written cluster).
TEST_F(Qcow2SnapshotOps, PowerLossAtEveryFlushLeavesSnapshotsWholeOrAbsent) {
  auto im = load();
  ASSERT_TRUE(run(create_snapshot(*im, NewSnapshot{"a", 1, 0})));
  write(0, kCs, std::byte{0x33});
  const std::vector<std::byte> base = mem_.content();
  enum Op { create, apply, remove };
  for (Op op : {create, apply, remove}) {
    bool completed = false;
    for (uint64_t cut = 1; !completed && cut < 64; ++cut) {
      io::MemFileOptions mo;
      mo.track_unflushed = true;
      io::MemFile f(mo, base);
      f.fail_from(io::OpKind::flush, cut, EIO);
      auto live = run(load_snapshot_image(f));
      ASSERT_TRUE(live) << live.status().to_string();
      Status st = op == create ? run(create_snapshot(**live, NewSnapshot{"b", 2, 0})).status()
                  : op == apply ? run(apply_snapshot(**live, "a"))
                                : run(delete_snapshot(**live, "1", "a"));
      completed = st.is_ok();
      for (uint64_t seed = 0; seed < 3; ++seed) {
        SCOPED_TRACE(fmt::format("op {} cut at flush {} seed {}", static_cast<int>(op), cut, seed));
        io::MemFile crashed(io::MemFileOptions{}, f.crash_image(seed * 7919 + cut));
        auto r = run(check_image(crashed, {}));
        ASSERT_TRUE(r) << r.status().to_string();
        uint64_t copied = 0;
        std::string messages;
        for (const auto& m : r->messages) {
          copied += m.find("OFLAG_COPIED") != std::string::npos;
          messages += m + "\n";
        }
        EXPECT_EQ(r->corruptions, copied) << messages;
        EXPECT_EQ(r->check_errors, 0u) << messages;
        auto h = run(read_qcow2_header(crashed));
        ASSERT_TRUE(h);
        auto t = run(read_qcow2_snapshots(crashed, *h));
        ASSERT_TRUE(t) << t.status().to_string();
        std::string names;
        for (const auto& sn : t->snapshots) names += sn.name;
        const std::byte active = byte_at(crashed, "", 0);
        const bool names_ok = op == create ? names == "a" || names == "ab"
                              : op == apply ? names == "a"
                                            : names == "a" || names.empty();
        EXPECT_TRUE(names_ok) << names;
        const bool active_ok = active == std::byte{0x33} || (op == apply && active == std::byte{0x11});
        EXPECT_TRUE(active_ok) << static_cast<int>(active);
        if (!names.empty()) {
          EXPECT_EQ(byte_at(crashed, "a", 0), std::byte{0x11});
          EXPECT_EQ(byte_at(crashed, "a", 2 << 20), std::byte{0x22});
        }
        if (names == "ab") {
          EXPECT_EQ(byte_at(crashed, "b", 0), std::byte{0x33});
        }
        if (::testing::Test::HasFailure()) return;
      }
    }
    EXPECT_TRUE(completed);
  }
}

TEST(Qcow2SnapshotTable, WrittenAsQemuWritesItAndParsedBack) {
  Snapshot a;
  a.id = "7";
  a.name = "old";
  a.l1_table_offset = 5 * kCs;
  a.l1_size = 1;
  a.disk_size = kDisk;
  a.extra.assign(40, std::byte{0x5a});  // longer than QEMU knows: the tail is kept
  Snapshot b = a;
  b.id = "12";
  b.name = "new";
  b.extra.clear();
  b.icount = 0;
  auto bytes = serialize_snapshot_table({a, b});
  ASSERT_TRUE(bytes) << bytes.status().to_string();
  Header h;
  h.size = kDisk;
  h.nb_snapshots = 2;
  h.snapshots_offset = 8 * kCs;
  auto t = parse_snapshot_table(*bytes, h, 1 << 30);
  ASSERT_TRUE(t) << t.status().to_string();
  ASSERT_EQ(t->snapshots.size(), 2u);
  EXPECT_EQ(t->table_bytes, bytes->size());
  EXPECT_EQ(t->snapshots[0].extra.size(), 40u);
  EXPECT_EQ(t->snapshots[0].extra[39], std::byte{0x5a});
  EXPECT_EQ(t->snapshots[0].icount, ~uint64_t{0});
  EXPECT_EQ(t->snapshots[1].extra.size(), sizeof(SnapshotExtraLayout));
  EXPECT_EQ(t->snapshots[1].icount, 0u);
  EXPECT_EQ(t->snapshots[1].disk_size, kDisk);
  EXPECT_EQ(next_snapshot_id(t->snapshots), "13");
  EXPECT_EQ(find_snapshot_by_id_and_name(t->snapshots, "12", "old"), -1);
  EXPECT_EQ(find_snapshot_by_id_and_name(t->snapshots, "", "new"), 1);
}

}  // namespace
}  // namespace qcowfs::image::qcow2
