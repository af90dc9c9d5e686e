// Helpers for the qcow2 unit tests: building header clusters byte by byte
// (independently of serialize_header) and damaging them field by field, and
// QemuImageTest, a fixture for driver tests over images qemu-img builds.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "image/endian.h"
#include "image/qcow2/format.h"
#include "io/engine.h"
#include "io/mem_file.h"
#include "unit/io/io_test_util.h"

namespace qcowfs::image::qcow2::testing {

using Bytes = std::vector<std::byte>;

inline void put32(Bytes& b, size_t off, uint32_t v) { store_be32(b.data() + off, v); }
inline void put64(Bytes& b, size_t off, uint64_t v) { store_be64(b.data() + off, v); }

// A valid v3 header cluster: 1 GiB disk, refcount table at cluster 1, L1
// table at cluster 3, no extensions (an end marker at header_length).
struct HeaderBuilder {
  uint32_t cluster_bits = 16;
  Bytes bytes;
  size_t ext_at = 0;
  uint32_t l1_entries = 0;

  explicit HeaderBuilder(uint32_t bits = 16, uint32_t version = 3) : cluster_bits(bits) {
    uint64_t cs = uint64_t{1} << bits;
    bytes.assign(cs, std::byte{0});
    put32(bytes, 0, kMagic);
    put32(bytes, 4, version);
    put32(bytes, 20, bits);
    uint64_t size = 1ull << 30;
    uint64_t per_l1 = (cs / 8) * cs;
    put64(bytes, 24, size);
    l1_entries = static_cast<uint32_t>((size + per_l1 - 1) / per_l1);
    put32(bytes, 36, l1_entries);
    put64(bytes, 40, 3 * cs);
    put64(bytes, 48, cs);
    put32(bytes, 56, 1);
    if (version == 3) {
      put32(bytes, 96, 4);
      put32(bytes, 100, 112);
      ext_at = 112;
    } else {
      ext_at = 72;
    }
  }
  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits; }
  // Header, refcount table, refcount block, L1 table and 12 spare clusters.
  uint64_t file_size() const { return 15 * cluster_size() + (uint64_t{l1_entries} * 8 + cluster_size() - 1) / cluster_size() * cluster_size(); }

  // Appends a header extension (padded to 8 bytes) and moves the end marker.
  HeaderBuilder& extension(uint32_t type, const Bytes& data) {
    put32(bytes, ext_at, type);
    put32(bytes, ext_at + 4, static_cast<uint32_t>(data.size()));
    std::memcpy(bytes.data() + ext_at + 8, data.data(), data.size());
    ext_at += 8 + (data.size() + 7) / 8 * 8;
    return *this;
  }
  HeaderBuilder& extension(uint32_t type, const std::string& s) {
    return extension(type, Bytes(reinterpret_cast<const std::byte*>(s.data()),
                                 reinterpret_cast<const std::byte*>(s.data()) + s.size()));
  }
  // Stores the backing file name right after the extensions.
  HeaderBuilder& backing(const std::string& name) {
    size_t at = ext_at + 8;
    std::memcpy(bytes.data() + at, name.data(), name.size());
    put64(bytes, 8, at);
    put32(bytes, 16, static_cast<uint32_t>(name.size()));
    return *this;
  }
  HeaderBuilder& feature_name(uint8_t type, uint8_t bit, const std::string& name) {
    Bytes e(48);
    e[0] = std::byte{type};
    e[1] = std::byte{bit};
    std::memcpy(e.data() + 2, name.data(), name.size());
    return extension(kExtFeatureTable, e);
  }
};

// A fixture owning a scratch directory /var/tmp/<tag>_<pid> (removed with its
// contents after the test), an engine of the given kind and the driver under
// test (closed before the directory goes).
class QemuImageTest : public ::testing::Test {
 protected:
  QemuImageTest(std::string tag, io::EngineKind kind) : tag_(std::move(tag)), kind_(kind) {}

  void SetUp() override {
    dir_ = std::filesystem::path("/var/tmp") / (tag_ + "_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    auto e = io::make_engine(kind_);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    engine_ = std::move(*e);
  }
  void TearDown() override {
    driver_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::string image_path() const { return (dir_ / "i.qcow2").string(); }

  // Runs shell commands in the scratch directory (output discarded); they
  // make i.qcow2, which is returned in a read-only MemFile.
  std::unique_ptr<io::MemFile> build_image(const std::string& commands) {
    std::string cmd = "cd '" + dir_.string() + "' && { " + commands + "; } >/dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    io::MemFileOptions o;
    o.writable = false;
    return std::make_unique<io::MemFile>(o, io::testing::read_file(image_path()));
  }

  std::filesystem::path dir_;
  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<BlockDriver> driver_;

 private:
  std::string tag_;
  io::EngineKind kind_;
};

}  // namespace qcowfs::image::qcow2::testing
