// resolve_relative(): backing and data file names as QEMU resolves them.
#include <gtest/gtest.h>

#include "image/path.h"

namespace qcowfs::image {
namespace {

TEST(ResolveRelative, RelativeNameIsRelativeToTheImagesDirectory) {
  EXPECT_EQ(resolve_relative("/srv/vm/disk.qcow2", "base.qcow2"), "/srv/vm/base.qcow2");
  EXPECT_EQ(resolve_relative("vm/disk.qcow2", "base.qcow2"), "vm/base.qcow2");
  EXPECT_EQ(resolve_relative("/srv/vm/disk.qcow2", "../base/b.raw"), "/srv/vm/../base/b.raw");
}

TEST(ResolveRelative, ImageInTheWorkingDirectoryKeepsTheName) {
  EXPECT_EQ(resolve_relative("disk.qcow2", "base.qcow2"), "base.qcow2");
  EXPECT_EQ(resolve_relative("disk.qcow2", "sub/base.qcow2"), "sub/base.qcow2");
}

TEST(ResolveRelative, AbsoluteNameIsKept) {
  EXPECT_EQ(resolve_relative("/srv/vm/disk.qcow2", "/images/base.qcow2"), "/images/base.qcow2");
  EXPECT_EQ(resolve_relative("disk.qcow2", "/images/base.qcow2"), "/images/base.qcow2");
}

TEST(ResolveRelative, EmptyNameNamesNoFile) {
  EXPECT_EQ(resolve_relative("/srv/vm/disk.qcow2", ""), "");
  EXPECT_EQ(resolve_relative("disk.qcow2", ""), "");
}

}  // namespace
}  // namespace qcowfs::image
