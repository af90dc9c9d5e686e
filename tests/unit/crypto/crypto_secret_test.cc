// SecretBuffer and KeyProvider: key files, standard input, the prompt on a pty.
#include <fcntl.h>
#include <pty.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "image/crypto/secret.h"

namespace qcowfs::image::crypto {
namespace {

std::string text(const SecretBuffer& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

std::span<const std::byte> bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

TEST(CryptoSecret, AllocatesPageBackedZeroedMemoryAndShrinks) {
  auto b = SecretBuffer::allocate(100);
  ASSERT_TRUE(b) << b.status().to_string();
  EXPECT_EQ(b->size(), 100u);
  for (std::byte c : b->span()) EXPECT_EQ(c, std::byte{0});
  std::memset(b->data(), 'x', 100);
  b->shrink(10);
  EXPECT_EQ(b->size(), 10u);
  // The wiped tail reads as zeros (still mapped: same page).
  EXPECT_EQ(b->data()[10], std::byte{0});
  EXPECT_EQ(b->data()[9], std::byte{'x'});
  // The page is excluded from dumps: mincore says it is resident (locked or touched).
  unsigned char vec = 0;
  ASSERT_EQ(mincore(b->data(), 1, &vec), 0);
  EXPECT_EQ(vec & 1, 1);
}

TEST(CryptoSecret, MovesOwnership) {
  auto a = SecretBuffer::copy_of(bytes("secret"));
  ASSERT_TRUE(a);
  SecretBuffer b = std::move(*a);
  EXPECT_EQ(text(b), "secret");
  EXPECT_TRUE(a->empty());
}

class TempFile {
 public:
  explicit TempFile(std::string_view content) {
    char tmpl[] = "/tmp/qcowfs-key-XXXXXX";
    int fd = mkstemp(tmpl);
    path_ = tmpl;
    EXPECT_EQ(::write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
    ::close(fd);
  }
  ~TempFile() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(CryptoSecret, KeyFileIsTheWholeContentNewlineIncluded) {
  TempFile f("pass word\n");
  auto p = KeyProvider::from_file(f.path());
  auto s = p->passphrase("disk.qcow2");
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(text(**s), "pass word\n");
  // Read once: the same secret afterwards, even when the file is gone.
  ::unlink(f.path().c_str());
  auto again = p->passphrase("disk.qcow2");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->get(), s->get());
}

TEST(CryptoSecret, NewlineAtTheEndOfAKeyFileIsNotedForARefusal) {
  TempFile with("pw\n"), without("pw");
  auto p = KeyProvider::from_file(with.path());
  EXPECT_EQ(p->refusal_note(), "");  // nothing read yet
  ASSERT_TRUE(p->passphrase("d.luks"));
  EXPECT_NE(p->refusal_note().find("the key file ends in a newline"), std::string::npos) << p->refusal_note();
  auto q = KeyProvider::from_file(without.path());
  ASSERT_TRUE(q->passphrase("d.luks"));
  EXPECT_EQ(q->refusal_note(), "");
  EXPECT_EQ(KeyProvider::from_bytes(bytes("pw\n"))->refusal_note(), "");  // not a file the user wrote
}

// A FIFO named as the key file is refused at once instead of blocking in open() (issue 31 item 3).
TEST(CryptoSecret, KeyFileThatIsAFifoIsRefusedWithoutBlocking) {
  const std::string fifo = ::testing::TempDir() + "/qcowfs_key_fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto s = KeyProvider::from_file(fifo)->passphrase("d.luks");
  ::unlink(fifo.c_str());
  ASSERT_FALSE(s);
  EXPECT_EQ(s.status().code(), EINVAL);
  EXPECT_EQ(s.status().message(), "key file " + fifo + " is a FIFO, not a regular file");
  auto dir = KeyProvider::from_file(::testing::TempDir())->passphrase("d.luks");
  ASSERT_FALSE(dir);
  EXPECT_NE(dir.status().message().find("is a directory, not a regular file"), std::string::npos);
}

TEST(CryptoSecret, MissingKeyFileNamesIt) {
  auto s = KeyProvider::from_file("/nonexistent/key")->passphrase("disk.qcow2");
  ASSERT_FALSE(s);
  EXPECT_EQ(s.status().code(), ENOENT);
  EXPECT_NE(s.status().message().find("/nonexistent/key"), std::string::npos);
}

TEST(CryptoSecret, ReadsAPipeToItsEnd) {
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  std::string big(10000, 'k');
  std::thread writer([&] {
    EXPECT_EQ(::write(p[1], big.data(), big.size()), static_cast<ssize_t>(big.size()));
    ::close(p[1]);
  });
  auto s = read_secret_fd(p[0], "a pipe");
  writer.join();
  ::close(p[0]);
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(text(*s), big);
}

TEST(CryptoSecret, NoTerminalAndNoKeyIsENOKEY) {
  // Standard input redirected from /dev/null is not a terminal.
  int saved = dup(STDIN_FILENO);
  int null = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(dup2(null, STDIN_FILENO), 0);
  auto s = KeyProvider::from_terminal()->passphrase("disk.qcow2");
  dup2(saved, STDIN_FILENO);
  ::close(saved);
  ::close(null);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.status().code(), ENOKEY);
  EXPECT_NE(s.status().message().find("key-file"), std::string::npos);
}

TEST(CryptoSecret, PromptsWithoutEchoOnAPty) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  // The user types once the prompt is shown (typeahead is flushed, as getpass does).
  std::string shown;
  std::thread user([&] {
    char out[256];
    while (shown.find(": ") == std::string::npos) {
      ssize_t n = ::read(master, out, sizeof(out));
      if (n <= 0) return;
      shown.append(out, static_cast<size_t>(n));
    }
    EXPECT_EQ(::write(master, "hunter2\n", 8), 8);
    // The newline the prompt prints afterwards.
    ssize_t n = ::read(master, out, sizeof(out));
    if (n > 0) shown.append(out, static_cast<size_t>(n));
  });
  auto s = prompt_secret(slave, "Passphrase for disk.qcow2: ");
  user.join();
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(text(*s), "hunter2");
  // What the terminal showed: the prompt and a newline, never the passphrase.
  EXPECT_NE(shown.find("Passphrase for disk.qcow2: "), std::string::npos);
  EXPECT_EQ(shown.find("hunter2"), std::string::npos) << shown;
  // Echo is back on afterwards.
  termios t{};
  ASSERT_EQ(tcgetattr(slave, &t), 0);
  EXPECT_NE(t.c_lflag & ECHO, 0u);
  ::close(master);
  ::close(slave);
}

}  // namespace
}  // namespace qcowfs::image::crypto
