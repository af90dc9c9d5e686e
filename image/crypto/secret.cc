// SecretBuffer and KeyProvider (crypto/secret.h).
#include <fcntl.h>
#include <sys/mman.h>
#include <termios.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <utility>

#include "image/crypto/secret.h"
#include "io/fd.h"
#include "io/log.h"
#include "io/small_file.h"

namespace qcowfs::image::crypto {

namespace {

size_t page_round(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

void warn_unlocked_once(int err) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    log::warn("cannot lock key material in memory ({}): it may be swapped out; raise RLIMIT_MEMLOCK",
              std::strerror(err));
}

}  // namespace

Result<SecretBuffer> SecretBuffer::allocate(size_t size) {
  SecretBuffer b;
  if (size == 0) return b;
  const size_t len = page_round(size);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Status::from_errno(errno, "mapping memory for key material");
  b.data_ = static_cast<std::byte*>(p);
  b.size_ = size;
  b.mapped_ = len;
  // Never in a core dump, never copied into a child.
  madvise(p, len, MADV_DONTDUMP);
  madvise(p, len, MADV_DONTFORK);
  if (mlock(p, len) != 0) warn_unlocked_once(errno);
  return b;
}

Result<SecretBuffer> SecretBuffer::copy_of(std::span<const std::byte> bytes) {
  auto b = allocate(bytes.size());
  if (b && !bytes.empty()) std::memcpy(b->data(), bytes.data(), bytes.size());
  return b;
}

SecretBuffer::~SecretBuffer() { release(); }

SecretBuffer::SecretBuffer(SecretBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

SecretBuffer& SecretBuffer::operator=(SecretBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

void SecretBuffer::shrink(size_t n) {
  if (n >= size_) return;
  explicit_bzero(data_ + n, size_ - n);
  size_ = n;
}

void SecretBuffer::release() {
  if (data_ == nullptr) return;
  explicit_bzero(data_, mapped_);
  munlock(data_, mapped_);
  munmap(data_, mapped_);
  data_ = nullptr;
  size_ = mapped_ = 0;
}

Result<SecretBuffer> read_secret_fd(int fd, std::string_view what) {
  size_t cap = 4096;
  auto buf = SecretBuffer::allocate(cap);
  if (!buf) return buf.status();
  size_t used = 0;
  for (;;) {
    if (used == cap) {
      if (cap >= kMaxPassphraseBytes)
        return Status::errorf(EFBIG, "{}: a passphrase longer than {} bytes", what, kMaxPassphraseBytes);
      auto bigger = SecretBuffer::allocate(cap * 2);
      if (!bigger) return bigger.status();
      std::memcpy(bigger->data(), buf->data(), used);
      *buf = std::move(*bigger);
      cap *= 2;
    }
    ssize_t n = ::read(fd, buf->data() + used, cap - used);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, fmt::format("reading {}", what));
    if (n == 0) break;
    used += static_cast<size_t>(n);
  }
  buf->shrink(used);
  return buf;
}

namespace {

// Echo off on the terminal for as long as it lives.
class EchoOff {
 public:
  explicit EchoOff(int fd) : fd_(fd) {
    if (tcgetattr(fd, &saved_) != 0) return;
    termios t = saved_;
    t.c_lflag &= static_cast<tcflag_t>(~(ECHO | ECHONL));
    t.c_lflag |= ICANON;
    active_ = tcsetattr(fd, TCSAFLUSH, &t) == 0;
  }
  ~EchoOff() {
    if (active_) tcsetattr(fd_, TCSAFLUSH, &saved_);
  }
  EchoOff(const EchoOff&) = delete;
  EchoOff& operator=(const EchoOff&) = delete;

 private:
  int fd_;
  termios saved_{};
  bool active_ = false;
};

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

// One byte at a time up to the newline, so nothing after it is consumed.
Result<SecretBuffer> prompt_secret(int tty_fd, std::string_view prompt) {
  auto buf = SecretBuffer::allocate(4096);
  if (!buf) return buf.status();
  size_t used = 0;
  {
    EchoOff quiet(tty_fd);
    write_all(tty_fd, prompt);
    for (;;) {
      char c;
      ssize_t n = ::read(tty_fd, &c, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::from_errno(errno, "reading the passphrase from the terminal");
      if (n == 0 || c == '\n' || c == '\r') break;
      if (used == buf->size()) return Status::errorf(EFBIG, "a typed passphrase longer than {} bytes", buf->size());
      buf->data()[used++] = static_cast<std::byte>(c);
    }
  }
  write_all(tty_fd, "\n");
  buf->shrink(used);
  return buf;
}

Status KeyProvider::keep(Result<SecretBuffer> secret) {
  if (!secret) return secret.status();
  cached_ = std::make_shared<const SecretBuffer>(std::move(*secret));
  return Status::ok();
}

std::shared_ptr<KeyProvider> KeyProvider::from_file(std::string path) {
  auto p = std::shared_ptr<KeyProvider>(new KeyProvider(Source::file, std::move(path)));
  if (p->path_ == "-") p->read_error_ = p->keep(read_secret_fd(STDIN_FILENO, "the passphrase on standard input"));
  return p;
}

std::shared_ptr<KeyProvider> KeyProvider::from_terminal(std::string how_to_give) {
  auto p = std::shared_ptr<KeyProvider>(new KeyProvider(Source::terminal, ""));
  p->how_to_give_ = std::move(how_to_give);
  if (isatty(STDIN_FILENO)) {
    p->tty_ = io::UniqueFd(::open("/dev/tty", O_RDWR | O_CLOEXEC | O_NOCTTY));
    if (p->tty_.get() < 0) p->tty_ = io::UniqueFd(::fcntl(STDIN_FILENO, F_DUPFD_CLOEXEC, 3));
  }
  return p;
}

std::shared_ptr<KeyProvider> KeyProvider::from_bytes(std::span<const std::byte> bytes) {
  auto p = std::shared_ptr<KeyProvider>(new KeyProvider(Source::fixed, ""));
  auto secret = SecretBuffer::copy_of(bytes);
  if (secret) p->cached_ = std::make_shared<const SecretBuffer>(std::move(*secret));
  return p;
}

Result<std::shared_ptr<const SecretBuffer>> KeyProvider::passphrase(std::string_view image) {
  std::lock_guard lock(mu_);
  if (cached_) return cached_;
  if (!read_error_) return read_error_;
  if (source_ == Source::fixed) return Status::error(ENOMEM, "the passphrase could not be kept in memory");
  auto secret = read_source(image);
  if (!secret) return secret.status();
  cached_ = std::make_shared<const SecretBuffer>(std::move(*secret));
  return cached_;
}

std::string KeyProvider::refusal_note() {
  std::lock_guard lock(mu_);
  if (source_ != Source::file || !cached_ || cached_->empty()) return {};
  if (cached_->data()[cached_->size() - 1] != std::byte{'\n'}) return {};
  const std::string_view source = path_ == "-" ? "the passphrase on standard input" : "the key file";
  return fmt::format("{} ends in a newline, which is part of the passphrase; write it with printf or echo -n",
                     source);
}

Result<SecretBuffer> KeyProvider::read_source(std::string_view image) const {
  if (source_ == Source::file) {
    if (path_ == "-") return read_secret_fd(STDIN_FILENO, "the passphrase on standard input");
    auto file = io::SmallFile::open(path_, kMaxPassphraseBytes, "key file");
    if (!file) return file.status();
    auto secret = SecretBuffer::allocate(file->size());
    if (!secret) return secret.status();
    QCOWFS_TRY(file->read(secret->span()));
    return secret;
  }
  if (tty_.get() < 0)
    return Status::errorf(ENOKEY, "{} is encrypted: give its passphrase with {}", image, how_to_give_);
  return prompt_secret(tty_.get(), fmt::format("Passphrase for {}: ", image));
}

}  // namespace qcowfs::image::crypto
