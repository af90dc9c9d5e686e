// Filesystem::serve_direct(): which messages it takes from libfuse. READ and
// WRITE whose lengths add up, and INTERRUPT, are served; anything shorter than
// its header and arguments, a length that is not the message's, a WRITE whose
// payload is shorter than its size, and every other opcode are left to
// libfuse (false), without reading past the message.
#include <gtest/gtest.h>

#include <linux/fuse.h>

#include <cstring>
#include <optional>
#include <vector>

#include "fuse/filesystem.h"
#include "fuse/inode_table.h"

namespace qcowfs::fuse {
namespace {

AttrContext context() {
  AttrContext c;
  c.view.mode = 0600;
  return c;
}

// A message of `opcode` for inode `ino` with `args` after its header; len is
// the message's size unless `len` is given.
std::vector<std::byte> message(uint32_t opcode, uint64_t ino, const void* args, size_t arg_bytes,
                               std::optional<uint32_t> len = std::nullopt) {
  std::vector<std::byte> m(sizeof(fuse_in_header) + arg_bytes);
  fuse_in_header in = {};
  in.len = len.value_or(static_cast<uint32_t>(m.size()));
  in.opcode = opcode;
  in.unique = 42;
  in.nodeid = ino;
  std::memcpy(m.data(), &in, sizeof in);
  if (arg_bytes) std::memcpy(m.data() + sizeof in, args, arg_bytes);
  return m;
}

// Nothing in the table is an image: a READ or WRITE it serves is answered with
// an error (ENOENT, EISDIR), which off a loop thread goes nowhere.
class FuseServeDirect : public testing::Test {
 protected:
  FuseServeDirect() : fs_(InodeTable::directory_root(), context(), Ino{0}, 0) {}
  bool serve(std::vector<std::byte> m) { return fs_.serve_direct(m); }
  Filesystem fs_;
};

TEST_F(FuseServeDirect, WellFormedReadsAndWritesAreServed) {
  fuse_read_in r = {};
  r.size = 4096;
  EXPECT_TRUE(serve(message(FUSE_READ, kRootIno, &r, sizeof r)));
  EXPECT_TRUE(serve(message(FUSE_READ, 12345, &r, sizeof r)));  // no such inode: ENOENT
  std::vector<std::byte> w(sizeof(fuse_write_in) + 512);
  fuse_write_in wa = {};
  wa.size = 512;
  std::memcpy(w.data(), &wa, sizeof wa);
  EXPECT_TRUE(serve(message(FUSE_WRITE, kRootIno, w.data(), w.size())));
}

TEST_F(FuseServeDirect, InterruptsAreDropped) {
  fuse_interrupt_in i = {};
  i.unique = 7;
  EXPECT_TRUE(serve(message(FUSE_INTERRUPT, 0, &i, sizeof i)));
}

TEST_F(FuseServeDirect, OtherOpcodesGoToLibfuse) {
  fuse_read_in r = {};
  const uint32_t others[] = {FUSE_INIT,      FUSE_LOOKUP, FUSE_GETATTR, FUSE_OPEN,    FUSE_FLUSH, FUSE_FSYNC,
                             FUSE_RELEASE,   FUSE_LSEEK,  FUSE_FORGET,  FUSE_DESTROY, 9999u,      FUSE_FALLOCATE};
  for (uint32_t op : others)
    EXPECT_FALSE(serve(message(op, kRootIno, &r, sizeof r))) << "opcode " << op;
}

TEST_F(FuseServeDirect, MessagesWhoseLengthsDoNotAddUpGoToLibfuse) {
  EXPECT_FALSE(serve({}));
  EXPECT_FALSE(serve(std::vector<std::byte>(sizeof(fuse_in_header) - 1)));
  fuse_read_in r = {};
  r.size = 4096;
  EXPECT_FALSE(serve(message(FUSE_READ, kRootIno, &r, sizeof r - 1)));  // arguments cut short
  const auto whole = message(FUSE_READ, kRootIno, &r, sizeof r);
  EXPECT_FALSE(serve(message(FUSE_READ, kRootIno, &r, sizeof r, static_cast<uint32_t>(whole.size() + 1))));
  EXPECT_FALSE(serve(message(FUSE_READ, kRootIno, &r, sizeof r, static_cast<uint32_t>(whole.size() - 1))));
  EXPECT_FALSE(serve(message(FUSE_READ, kRootIno, &r, sizeof r, 0)));
  auto extended = message(FUSE_READ, kRootIno, &r, sizeof r);
  reinterpret_cast<fuse_in_header*>(extended.data())->total_extlen = 1;  // request extensions follow
  EXPECT_FALSE(serve(extended));

  fuse_write_in wa = {};
  EXPECT_FALSE(serve(message(FUSE_WRITE, kRootIno, &wa, sizeof wa - 1)));
  std::vector<std::byte> w(sizeof(fuse_write_in) + 511);
  wa.size = 512;  // one byte more than the payload
  std::memcpy(w.data(), &wa, sizeof wa);
  EXPECT_FALSE(serve(message(FUSE_WRITE, kRootIno, w.data(), w.size())));
  wa.size = UINT32_MAX;
  std::memcpy(w.data(), &wa, sizeof wa);
  EXPECT_FALSE(serve(message(FUSE_WRITE, kRootIno, w.data(), w.size())));
}

}  // namespace
}  // namespace qcowfs::fuse
