// ForwardingFile: a HostFile that passes every call to another one (owned or
// borrowed): a borrowed file handed to code that takes ownership of one, and in
// tests, files that observe or gate some calls derive from it and
// override only those. A borrowed file must outlive the ForwardingFile.
// Thread-safety: that of the file it forwards to.
#pragma once

#include <memory>
#include <string>

#include "io/host_file.h"

namespace qcowfs::io {

class ForwardingFile : public HostFile {
 public:
  explicit ForwardingFile(HostFile& f) : f_(&f) {}
  explicit ForwardingFile(std::unique_ptr<HostFile> owned) : owned_(std::move(owned)), f_(owned_.get()) {}

  Task<Result<size_t>> read(uint64_t off, std::span<std::byte> buf) override { return f_->read(off, buf); }
  Task<Result<size_t>> readv(uint64_t off, std::span<const iovec> iov) override { return f_->readv(off, iov); }
  Task<Status> write(uint64_t off, std::span<const std::byte> buf) override { return f_->write(off, buf); }
  Task<Status> writev(uint64_t off, std::span<const iovec> iov) override { return f_->writev(off, iov); }
  Task<Status> flush() override { return f_->flush(); }
  Task<Status> discard(uint64_t off, uint64_t len) override { return f_->discard(off, len); }
  Task<Status> write_zeroes(uint64_t off, uint64_t len) override { return f_->write_zeroes(off, len); }
  Task<Status> truncate(uint64_t size) override { return f_->truncate(size); }
  Task<Result<uint64_t>> seek_data(uint64_t off) override { return f_->seek_data(off); }
  Task<Result<uint64_t>> seek_hole(uint64_t off) override { return f_->seek_hole(off); }
  uint64_t size() const override { return f_->size(); }
  uint64_t allocated_bytes() const override { return f_->allocated_bytes(); }
  size_t mem_align() const override { return f_->mem_align(); }
  size_t offset_align() const override { return f_->offset_align(); }
  bool is_block_device() const override { return f_->is_block_device(); }
  bool writable() const override { return f_->writable(); }
  CacheMode cache_mode() const override { return f_->cache_mode(); }
  const std::string& path() const override { return f_->path(); }
  int kernel_fd() const override { return f_->kernel_fd(); }
  size_t direct_io_align() const override { return f_->direct_io_align(); }

 protected:
  HostFile& inner() const { return *f_; }

 private:
  std::unique_ptr<HostFile> owned_;
  HostFile* f_;
};

}  // namespace qcowfs::io
