// Loan: bytes a reader may read in place instead of having them copied into
// its buffer: a HostFile's own memory (a remote object's cache blocks,
// HostFile::lend) and shared zeros, in pieces in offset order. The holds keep
// the lent memory alive and unchanged until the loan is dropped; a reader
// only reads it (a FUSE reply is written from it) and drops the loan soon.
//
// Thread-safety: a value; the lent memory is immutable while it is held, so
// any thread may read it.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace qcowfs::io {

struct Loan {
  std::vector<iovec> pieces;
  std::vector<std::shared_ptr<const void>> holds;
  uint64_t bytes = 0;

  // n bytes at p (kept alive by hold; nullptr for static memory), after the
  // pieces already there; a piece that continues the last one joins it.
  void add(const void* p, size_t n, std::shared_ptr<const void> hold = nullptr);
  // n zero bytes (pieces of the shared zero buffer).
  void add_zeros(uint64_t n);
  // The pieces and holds of other, after these.
  void append(Loan&& other);
};

}  // namespace qcowfs::io
