// Helpers for the crypto tests: LUKS images made by qemu-img (with the retry
// its PBKDF2 benchmark needs on a loaded machine), cryptsetup's key dump as the
// referee, and reading a whole file.
// Thread-safety: test helpers, call from one thread.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "unit/io/io_test_util.h"

namespace qcowfs::image::crypto::testing {

using io::testing::read_file;

// "MK dump:\t28 e5 ...\n\t\t ..." -> bytes; "Payload offset:\t1032" -> bytes.
struct Dump {
  std::vector<std::byte> key;
  uint64_t payload_offset = 0;
};

inline Dump dump_luks(const std::string &image, const std::string &pass_file) {
  std::string out;
  const int rc = io::testing::run_command(
      fmt::format("cryptsetup luksDump -q --dump-master-key --key-file {} {}", pass_file, image), &out);
  EXPECT_EQ(rc, 0) << out;
  Dump d;
  std::istringstream in(out);
  std::string line;
  bool in_key = false;
  while (std::getline(in, line)) {
    if (line.rfind("Payload offset:", 0) == 0) d.payload_offset = std::stoull(line.substr(15)) * 512;
    if (line.rfind("MK dump:", 0) == 0) {
      in_key = true;
      line = line.substr(8);
    } else if (in_key && (line.empty() || line[0] != '\t')) {
      in_key = false;
    }
    if (!in_key) continue;
    std::istringstream hex(line);
    std::string b;
    while (hex >> b) d.key.push_back(static_cast<std::byte>(std::stoul(b, nullptr, 16)));
  }
  return d;
}

// The shell prefix that preloads tests/support/fast_cpu_clock.c into a
// qemu-img creating a LUKS header, so its PBKDF2 calibration takes one short
// round instead of 2-3 s of CPU (iter-time=10 shortens only the iterations it
// then picks): for tests that do not test qemu-img's key derivation.
inline std::string fast_kdf_calibration() { return std::string("LD_PRELOAD=") + QCOWFS_FAST_CPU_CLOCK + " "; }

// qemu-img create -f luks (passphrase "pw", `size`, calibration cut short as above) with opts such as
// "key-secret=s0,iter-time=10,cipher-alg=aes-256". qemu-img times PBKDF2
// starting with 2^15 iterations and fails with "Unable to get accurate CPU
// usage" when they take less than a tick of thread CPU time: with SHA-NI
// (sha256, sha1) that is most runs here, so the PBKDF2 hash is sha512 unless
// opts name one (ripemd160, sha384 and sha512 never failed in tests), and
// that one error is retried.
inline int qemu_img_create_luks(const std::string &path, std::string opts, std::string *out,
                                const std::string &size = "1M") {
  if (opts.find(",hash-alg=") == std::string::npos && opts.rfind("hash-alg=", 0) != 0) opts += ",hash-alg=sha512";
  int rc = -1;
  for (int attempt = 0; attempt < 8; ++attempt) {
    rc = io::testing::run_command(fmt::format("{}qemu-img create -q --object "
                                              "secret,id=s0,data=pw -f luks -o {} {} {}",
                                              fast_kdf_calibration(), opts, path, size),
                                  out);
    if (rc == 0 || out->find("accurate CPU usage") == std::string::npos) break;
  }
  return rc;
}

}  // namespace qcowfs::image::crypto::testing
