// Which views the kernel may serve from the image file itself (FUSE
// passthrough): ImageFile::passthrough_file() and the backing it is given.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "fuse/image_file.h"
#include "image/raw/raw.h"
#include "io/mem_file.h"

namespace qcowfs::fuse {
namespace {

std::unique_ptr<image::RawDriver> raw_over(size_t direct_io_align, bool block_device = false) {
  io::MemFileOptions o;
  o.direct_io_align = direct_io_align;
  o.block_device = block_device;
  return std::make_unique<image::RawDriver>(std::make_unique<io::MemFile>(o, std::vector<std::byte>(1 << 20)),
                                            false);
}

TEST(FusePassthrough, ReadOnlyViewOfAWholeRawFileQualifies) {
  auto raw = raw_over(512);
  EXPECT_EQ(ImageFile(raw.get(), false).passthrough_file(), &raw->file());
}

// Writes must reach the daemon (fixed size, ENOSPC at the end), and the
// kernel fails ordinary opens of a file that has passed-through ones.
TEST(FusePassthrough, WritableViewsDoNot) {
  auto raw = raw_over(512);
  EXPECT_EQ(ImageFile(raw.get(), true).passthrough_file(), nullptr);
}

TEST(FusePassthrough, WindowsAndDevicesDoNot) {
  auto raw = raw_over(512);
  image::RawDriver window(&raw->file(), false, 4096, 8192);  // a partition: offsets differ
  EXPECT_EQ(ImageFile(&window, false).passthrough_file(), nullptr);
  auto dev = raw_over(512, true);  // the kernel takes only regular files as backing
  EXPECT_EQ(ImageFile(dev.get(), false).passthrough_file(), nullptr);
}

// O_DIRECT readers would meet the host's alignment instead of ours (any).
TEST(FusePassthrough, OnlyHostsWithSectorAlignmentOrFiner) {
  for (size_t align : {size_t{1}, size_t{4}, size_t{512}}) {
    auto raw = raw_over(align);
    EXPECT_NE(ImageFile(raw.get(), false).passthrough_file(), nullptr) << align;
  }
  for (size_t align : {size_t{0}, size_t{1024}, size_t{4096}}) {  // 0: the host does not say
    auto raw = raw_over(align);
    EXPECT_EQ(ImageFile(raw.get(), false).passthrough_file(), nullptr) << align;
  }
}

TEST(FusePassthrough, NoBackingUntilEnabled) {
  auto raw = raw_over(512);
  ImageFile view(raw.get(), false);
  EXPECT_EQ(view.backing_id(), -1);
  view.enable_passthrough(7);
  EXPECT_EQ(view.backing_id(), 7);
}

}  // namespace
}  // namespace qcowfs::fuse
