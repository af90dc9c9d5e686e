// The hostile-image corpus (tests/qcowfs_testlib/hostile.py) through the engine, with
// no FUSE in between. ctest's hostile_corpus.build fixture writes the corpus
// (tests/CMakeLists.txt) and passes its directory as QCOWFS_HOSTILE_CORPUS;
// this test only reads it. Every case is opened with open_image() over the
// real host file and checked against its expected outcome from manifest.tsv:
//   refused   open fails, with a message matching the case's pattern;
//   eio       open works, each bad range reads EIO, each good range reads what
//             the pristine image held;
//   readable  open works, the whole disk reads as `qemu-img convert` shows it.
// Under the asan preset this runs every corrupt image through the sanitizers.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <cctype>
#include <sstream>
#include <string>
#include <vector>

#include "image/block_driver.h"
#include "io/buffer.h"
#include "io/engine.h"
#include "io/run_sync.h"

namespace qcowfs::image {
namespace {

namespace fs = std::filesystem;

struct Range {
  uint64_t off = 0;
  uint64_t len = 0;
};

struct CorpusCase {
  std::string outcome, name, image;
  std::vector<std::string> fields;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);) out.push_back(item);
  return out;
}

std::vector<Range> parse_ranges(const std::string& s) {
  std::vector<Range> out;
  for (const std::string& r : split(s, ',')) {
    auto colon = r.find(':');
    out.push_back(Range{std::stoull(r.substr(0, colon)), std::stoull(r.substr(colon + 1))});
  }
  return out;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return s;
}

// The corpus patterns are alternations of literal words ("a|b c|d"), matched
// case-insensitively like the Python side's re.search.
bool matches_any(const std::string& text, const std::string& pattern) {
  std::string t = lower(text);
  for (const std::string& alt : split(pattern, '|'))
    if (t.find(lower(alt)) != std::string::npos) return true;
  return false;
}

std::string slurp(const std::string& path, uint64_t off, uint64_t len) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(off));
  std::string s(len, '\0');
  in.read(s.data(), static_cast<std::streamsize>(len));
  s.resize(static_cast<size_t>(in.gcount()));
  return s;
}

class HostileCorpus : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("QCOWFS_HOSTILE_CORPUS");
    ASSERT_TRUE(dir && *dir) << "QCOWFS_HOSTILE_CORPUS is not set: run this test through ctest, whose "
                                "hostile_corpus.build fixture writes the corpus and sets it";
    dir_ = dir;
    ASSERT_TRUE(fs::exists(dir_ / "manifest.tsv")) << dir_ << " holds no manifest.tsv: the corpus was not built";
    auto e = io::make_engine(io::EngineKind::automatic);
    ASSERT_TRUE(e.is_ok());
    engine_ = std::move(*e);
  }

  std::vector<CorpusCase> cases() {
    std::vector<CorpusCase> out;
    std::ifstream in(dir_ / "manifest.tsv");
    for (std::string line; std::getline(in, line);) {
      auto f = split(line, '\t');
      if (f.size() < 4) continue;
      out.push_back(CorpusCase{f[0], f[1], f[2], std::vector<std::string>(f.begin() + 3, f.end())});
    }
    return out;
  }

  Result<std::unique_ptr<BlockDriver>> open(const std::string& path) {
    return io::run_sync(*engine_, open_image(path, ImageOptions{}));
  }

  Result<std::string> read(BlockDriver& d, uint64_t off, uint64_t len) {
    io::AlignedBuffer buf(static_cast<size_t>(len), d.mem_align(), true);
    Status st = io::run_sync(*engine_, d.read(off, buf.span()));
    if (!st) return st;
    return std::string(reinterpret_cast<const char*>(buf.data()), static_cast<size_t>(len));
  }

  void check_refused(const CorpusCase& c) {
    auto d = open(c.image);
    ASSERT_FALSE(d) << "opened although it must be refused";
    EXPECT_TRUE(matches_any(d.status().message(), c.fields.at(0)))
        << "message '" << d.status().message() << "' does not match /" << c.fields[0] << "/";
  }

  void check_eio(const CorpusCase& c) {
    auto d = open(c.image);
    ASSERT_TRUE(d) << d.status().to_string();
    for (Range r : parse_ranges(c.fields.at(1))) {
      auto got = read(**d, r.off, r.len);
      ASSERT_FALSE(got) << "bad range " << r.off << "+" << r.len << " read without error";
      EXPECT_EQ(got.status().code(), EIO) << got.status().to_string();
    }
    for (Range r : parse_ranges(c.fields.at(2))) {
      auto got = read(**d, r.off, r.len);
      ASSERT_TRUE(got) << "good range " << r.off << "+" << r.len << ": " << got.status().to_string();
      EXPECT_TRUE(*got == slurp(c.fields[0], r.off, r.len)) << "good range " << r.off << " differs";
    }
  }

  void check_readable(const CorpusCase& c) {
    auto d = open(c.image);
    ASSERT_TRUE(d) << d.status().to_string();
    const uint64_t size = (*d)->size();
    ASSERT_EQ(size, fs::file_size(c.fields.at(0)));
    constexpr uint64_t kChunk = 1 << 20;
    for (uint64_t off = 0; off < size; off += kChunk) {
      uint64_t n = std::min(kChunk, size - off);
      auto got = read(**d, off, n);
      ASSERT_TRUE(got) << "at " << off << ": " << got.status().to_string();
      ASSERT_TRUE(*got == slurp(c.fields[0], off, n)) << "differs from qemu-img convert at " << off;
    }
  }

  fs::path dir_;
  std::unique_ptr<io::Engine> engine_;
};

TEST_F(HostileCorpus, EveryCaseHasItsExpectedOutcomeThroughTheDriver) {
  auto all = cases();
  ASSERT_GE(all.size(), 30u);
  for (const CorpusCase& c : all) {
    SCOPED_TRACE(c.name);
    if (c.outcome == "refused") {
      check_refused(c);
    } else if (c.outcome == "eio") {
      check_eio(c);
    } else {
      ASSERT_EQ(c.outcome, "readable");
      check_readable(c);
    }
  }
}

}  // namespace
}  // namespace qcowfs::image
