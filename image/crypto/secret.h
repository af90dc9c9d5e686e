// SecretBuffer: key material or a passphrase in memory that is locked (mlock:
// never swapped out), left out of core dumps (MADV_DONTDUMP) and wiped
// (explicit_bzero) when the buffer is destroyed or shrunk. KeyProvider: where
// the passphrase of an encrypted image comes from (a key file, standard input,
// or a prompt without echo on the terminal), read once and kept as a secret.
//
// Thread-safety: a SecretBuffer is a move-only value (not shared between
// threads while written). KeyProvider::passphrase may be called from any
// thread; the first call reads the source, later calls return the same secret.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "io/fd.h"
#include "io/status.h"

namespace qcowfs::image::crypto {

class SecretBuffer {
 public:
  SecretBuffer() = default;
  // size bytes of zeros in locked, non-dumpable pages. ENOMEM when the pages
  // cannot be mapped; a failed mlock (RLIMIT_MEMLOCK) is logged once, not fatal.
  static Result<SecretBuffer> allocate(size_t size);
  static Result<SecretBuffer> copy_of(std::span<const std::byte> bytes);
  ~SecretBuffer();
  SecretBuffer(SecretBuffer&& other) noexcept;
  SecretBuffer& operator=(SecretBuffer&& other) noexcept;
  SecretBuffer(const SecretBuffer&) = delete;
  SecretBuffer& operator=(const SecretBuffer&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() { return {data_, size_}; }
  std::span<const std::byte> span() const { return {data_, size_}; }
  // Keeps the first n bytes (n <= size()) and wipes the rest.
  void shrink(size_t n);

 private:
  void release();
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
};

// The longest passphrase read from a key file or standard input (QEMU's secret
// objects have no limit; cryptsetup's default key-file limit is 8 MiB).
inline constexpr size_t kMaxPassphraseBytes = 8 << 20;

class KeyProvider {
 public:
  // -o key-file=PATH: the passphrase is the file's whole content (as QEMU's
  // secret file=, no newline stripped), read through io::SmallFile (a regular
  // file only: a FIFO or device is refused, never waited on); "-" reads
  // standard input to its end at once (before the daemon lets go of its
  // standard input).
  static std::shared_ptr<KeyProvider> from_file(std::string path);
  // No key given: prompts on the controlling terminal (without echo) when
  // standard input is a terminal; otherwise passphrase() fails with ENOKEY.
  // The terminal is opened now and kept, so that a daemon that has left its
  // session can still ask on it. how_to_give: the option that gives a key,
  // named in the ENOKEY message (the mount's by default; the tools' differs).
  static std::shared_ptr<KeyProvider> from_terminal(
      std::string how_to_give = "-o key-file=PATH (or key-file=- for standard input)");
  // A fixed passphrase (tests, tools that already hold one).
  static std::shared_ptr<KeyProvider> from_bytes(std::span<const std::byte> bytes);

  // The passphrase, read from the source on the first call. image names the
  // image in the prompt and in messages. ENOKEY: no key was given and there
  // is no terminal to ask; EIO/ENOENT/EACCES: the key file cannot be read.
  Result<std::shared_ptr<const SecretBuffer>> passphrase(std::string_view image);
  // Why a passphrase read from a key file or standard input may have been
  // refused although the user typed the right one: its last byte is a
  // newline (`echo pw > f`), which is kept as part of the passphrase (as
  // cryptsetup and QEMU keep it). Empty when there is nothing to say.
  std::string refusal_note();

 private:
  enum class Source { file, terminal, fixed };
  KeyProvider(Source source, std::string path) : source_(source), path_(std::move(path)) {}
  Result<SecretBuffer> read_source(std::string_view image) const;
  Status keep(Result<SecretBuffer> secret);

  Source source_;
  std::string path_;
  std::string how_to_give_;  // Source::terminal: named in the ENOKEY message
  io::UniqueFd tty_;  // Source::terminal: the terminal to prompt on (none: ENOKEY)
  std::mutex mu_;
  std::shared_ptr<const SecretBuffer> cached_;
  Status read_error_;  // key-file=-: why standard input gave no passphrase
};

// Reads all of fd (up to kMaxPassphraseBytes; EFBIG beyond) into a SecretBuffer.
Result<SecretBuffer> read_secret_fd(int fd, std::string_view what);
// Prints prompt on the terminal tty_fd and reads one line with echo off (the
// newline is not part of the passphrase); the terminal's mode is restored.
Result<SecretBuffer> prompt_secret(int tty_fd, std::string_view prompt);

}  // namespace qcowfs::image::crypto
