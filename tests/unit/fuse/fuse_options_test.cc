#include <gtest/gtest.h>

#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "fuse/options.h"

namespace qcowfs::fuse {
namespace {

Result<Options> parse(std::vector<std::string> args) { return parse_command_line(args); }

TEST(FuseOptions, DefaultsAreReadOnlyForeground) {
  auto o = parse({"-f", "disk.qcow2", "/mnt/x"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->image, "disk.qcow2");
  EXPECT_EQ(o->mountpoint, "/mnt/x");
  EXPECT_TRUE(o->foreground);
  EXPECT_FALSE(o->debug);
  EXPECT_FALSE(o->writable());
  EXPECT_FALSE(o->image_options.file.cache.has_value());
  EXPECT_EQ(o->queues, 0u);
  EXPECT_EQ(o->aio, io::EngineKind::automatic);
  EXPECT_FALSE(o->image_options.discard_unmap);
  EXPECT_FALSE(o->image_options.compress_writes);
}

TEST(FuseOptions, AllValuedOptions) {
  auto o = parse({"-o", "rw,cache=none,aio=threads,queues=3,format=qcow2,discard=unmap,l2_cache_size=4M,allow_other",
                  "img", "mnt"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_TRUE(o->writable());
  EXPECT_EQ(o->image_options.file.cache, io::CacheMode::none);
  
  EXPECT_EQ(o->aio, io::EngineKind::threads);
  EXPECT_EQ(o->queues, 3u);
  EXPECT_EQ(o->image_options.format, "qcow2");
  EXPECT_TRUE(o->image_options.discard_unmap);
  EXPECT_EQ(o->image_options.table_cache_size, 4u << 20);
  EXPECT_TRUE(o->allow_other);
  auto compress = parse({"-o", "rw,compress=on", "img", "mnt"});
  ASSERT_TRUE(compress) << compress.status().to_string();
  EXPECT_TRUE(compress->image_options.compress_writes);
  auto alias = parse({"-o", "table_cache_size=64K", "img", "mnt"});
  ASSERT_TRUE(alias) << alias.status().to_string();
  EXPECT_EQ(alias->image_options.table_cache_size, 64u << 10);
}

TEST(FuseOptions, OptionsAfterPositionalsAsMountFuseSendsThem) {
  auto o = parse({"img", "mnt", "-o", "rw,dev,suid,noauto,_netdev,x-systemd.automount"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_TRUE(o->writable());
  EXPECT_FALSE(o->foreground);
}

TEST(FuseOptions, LaterOptionWins) {
  auto o = parse({"-o", "rw", "-oro", "img", "mnt"});
  ASSERT_TRUE(o);
  EXPECT_FALSE(o->writable());
  o = parse({"-o", "ro,rw", "img", "mnt"});
  ASSERT_TRUE(o);
  EXPECT_TRUE(o->writable());
}

TEST(FuseOptions, DebugImpliesForeground) {
  auto o = parse({"-d", "img", "mnt"});
  ASSERT_TRUE(o);
  EXPECT_TRUE(o->debug);
  EXPECT_TRUE(o->foreground);
}

TEST(FuseOptions, SnapshotOption) {
  auto o = parse({"-o", "snapshot=before upgrade", "img", "mnt"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->image_options.snapshot, "before upgrade");
}

TEST(FuseOptions, SnapshotWithRwIsRejected) {
  auto o = parse({"-o", "snapshot=s1,rw", "img", "mnt"});
  ASSERT_FALSE(o);
  EXPECT_EQ(o.status().code(), EINVAL);
  EXPECT_NE(o.status().message().find("read-only"), std::string::npos);
}

// throwaway: a writable view over an image opened read-only, whatever rw says.
TEST(FuseOptions, ThrowawayIsAWritableViewOfAReadOnlyImage) {
  for (const char* list : {"throwaway", "rw,throwaway", "throwaway,rw", "throwaway,force-share"}) {
    auto o = parse({"-o", list, "img", "mnt"});
    ASSERT_TRUE(o) << list << ": " << o.status().to_string();
    EXPECT_TRUE(o->throwaway) << list;
    EXPECT_TRUE(o->writable()) << list;
    EXPECT_FALSE(o->image_options.file.writable) << list;
  }
  auto plain = parse({"-o", "rw", "img", "mnt"});
  ASSERT_TRUE(plain);
  EXPECT_FALSE(plain->throwaway);
  auto snap = parse({"-o", "snapshot=s1,throwaway", "img", "mnt"});
  ASSERT_FALSE(snap);
  EXPECT_NE(snap.status().message().find("throwaway"), std::string::npos) << snap.status().message();
}

struct BadCase {
  std::vector<std::string> args;
  std::string must_mention;
};

TEST(FuseOptions, BadInputNamesTheCulprit) {
  const std::vector<BadCase> cases = {
      {{"-o", "bogus", "img", "mnt"}, "bogus"},
      {{"-o", "bogus=1", "img", "mnt"}, "bogus=1"},
      {{"-o", "cache=fast", "img", "mnt"}, "fast"},
      {{"-o", "aio=posix", "img", "mnt"}, "posix"},
      {{"-o", "queues=0", "img", "mnt"}, "queues"},
      {{"-o", "queues=65", "img", "mnt"}, "queues"},
      {{"-o", "queues=2x", "img", "mnt"}, "2x"},
      {{"-o", "format=nosuchfmt", "img", "mnt"}, "nosuchfmt"},
      {{"-o", "discard=on", "img", "mnt"}, "discard"},
      {{"-o", "rw,compress=yes", "img", "mnt"}, "compress"},
      {{"-o", "compress=on", "img", "mnt"}, "needs rw"},
      {{"-o", "fuse_uring=yes", "img", "mnt"}, "fuse_uring"},
      {{"-o", "passthrough=on", "img", "mnt"}, "passthrough"},
      {{"-o", "l2_cache_size=12Q", "img", "mnt"}, "12Q"},
      {{"-o", "table_cache_size=12Q", "img", "mnt"}, "12Q"},
      {{"-o", "snapshot=", "img", "mnt"}, "snapshot"},
      {{"-o", "uid=", "img", "mnt"}, "uid"},
      {{"-o", "uid=12ab", "img", "mnt"}, "12ab"},
      {{"-o", "uid=-1", "img", "mnt"}, "uid"},
      {{"-o", "uid=4294967295", "img", "mnt"}, "uid"},
      {{"-o", "uid=no-such-user-qcowfs", "img", "mnt"}, "no-such-user-qcowfs"},
      {{"-o", "gid=no-such-group-qcowfs", "img", "mnt"}, "no-such-group-qcowfs"},
      {{"-o", "umask=8", "img", "mnt"}, "umask"},
      {{"-o", "umask=1000", "img", "mnt"}, "1000"},
      {{"-o", "umask=", "img", "mnt"}, "umask"},
      {{"-o", "fmask=0x22", "img", "mnt"}, "fmask"},
      {{"-o", "dmask=-22", "img", "mnt"}, "dmask"},
      {{"--frobnicate", "img", "mnt"}, "--frobnicate"},
      {{"img"}, "IMAGE and MOUNTPOINT"},
      {{"img", "mnt", "extra"}, "3 arguments"},
      {{"img", "mnt", "-o"}, "-o"},
  };
  for (const auto& c : cases) {
    auto o = parse(c.args);
    ASSERT_FALSE(o) << "accepted: " << c.args[0] << " " << (c.args.size() > 1 ? c.args[1] : "");
    EXPECT_EQ(o.status().code(), EINVAL);
    EXPECT_NE(o.status().message().find(c.must_mention), std::string::npos)
        << "message '" << o.status().message() << "' does not mention '" << c.must_mention << "'";
  }
}

TEST(FuseOptions, AccessOptions) {
  auto o = parse({"-o", "allow_other,uid=1234,gid=99,umask=027", "img", "mnt"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->access.uid, 1234u);
  EXPECT_EQ(o->access.gid, 99u);
  EXPECT_EQ(o->access.fmask, 027u);
  EXPECT_EQ(o->access.dmask, 027u);
  auto none = parse({"img", "mnt"});
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->access.uid || none->access.gid || none->access.fmask || none->access.dmask);
}

TEST(FuseOptions, FmaskAndDmaskOverrideUmaskInOrder) {
  auto o = parse({"-o", "umask=022,fmask=077", "img", "mnt"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->access.fmask, 077u);
  EXPECT_EQ(o->access.dmask, 022u);
  auto later = parse({"-o", "dmask=077,umask=0", "img", "mnt"});  // later options win
  ASSERT_TRUE(later);
  EXPECT_EQ(later->access.fmask, 0u);
  EXPECT_EQ(later->access.dmask, 0u);
  auto d = parse({"-o", "dmask=0700", "img", "mnt"});
  ASSERT_TRUE(d);
  EXPECT_FALSE(d->access.fmask);
  EXPECT_EQ(d->access.dmask, 0700u);
}

TEST(FuseOptions, NamesAreLookedUp) {
  auto o = parse({"-o", "allow_other,uid=root,gid=root", "img", "mnt"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->access.uid, 0u);
  EXPECT_EQ(o->access.gid, 0u);
}

TEST(FuseOptions, AnotherOwnerNeedsAllowOther) {
  const std::string other_uid = std::to_string(::getuid() + 1);
  const std::string other_gid = std::to_string(::getgid() + 1);
  for (const std::string& opt : {"uid=" + other_uid, "gid=" + other_gid}) {
    auto o = parse({"-o", opt, "img", "mnt"});
    ASSERT_FALSE(o) << opt;
    EXPECT_EQ(o.status().code(), EINVAL);
    EXPECT_NE(o.status().message().find("allow_other"), std::string::npos) << o.status().message();
    EXPECT_TRUE(parse({"-o", opt + ",allow_other", "img", "mnt"})) << opt;
    EXPECT_TRUE(parse({"-o", "allow_other", "-o", opt, "img", "mnt"})) << opt;
  }
  // Naming yourself, or only masking bits, needs nothing.
  EXPECT_TRUE(parse({"-o", "uid=" + std::to_string(::getuid()) + ",gid=" + std::to_string(::getgid()), "img", "mnt"}));
  EXPECT_TRUE(parse({"-o", "umask=077", "img", "mnt"}));
}

TEST(FuseOptions, HelpAndVersionNeedNoPositionals) {
  auto h = parse({"--help"});
  ASSERT_TRUE(h);
  EXPECT_TRUE(h->help);
  auto v = parse({"-V"});
  ASSERT_TRUE(v);
  EXPECT_TRUE(v->version);
}

TEST(FuseOptions, ParseSize) {
  EXPECT_EQ(*parse_size("4096"), 4096u);
  EXPECT_EQ(*parse_size("64K"), 65536u);
  EXPECT_EQ(*parse_size("64k"), 65536u);
  EXPECT_EQ(*parse_size("3M"), 3u << 20);
  EXPECT_EQ(*parse_size("2G"), uint64_t{2} << 30);
  EXPECT_EQ(*parse_size("1T"), uint64_t{1} << 40);
  EXPECT_FALSE(parse_size(""));
  EXPECT_FALSE(parse_size("M"));
  EXPECT_FALSE(parse_size("1MB"));
  EXPECT_FALSE(parse_size("-1"));
  EXPECT_FALSE(parse_size("99999999999999999999"));
  EXPECT_FALSE(parse_size("17179869184G"));  // 2^34 G overflows 64 bits
}

TEST(FuseOptions, FuseUringModes) {
  auto d = parse({"img", "mnt"});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->fuse_uring, FuseUringMode::automatic);
  for (auto [text, mode] : {std::pair{"auto", FuseUringMode::automatic}, std::pair{"on", FuseUringMode::on},
                            std::pair{"off", FuseUringMode::off}}) {
    auto o = parse({"-o", std::string("fuse_uring=") + text, "img", "mnt"});
    ASSERT_TRUE(o) << o.status().to_string();
    EXPECT_EQ(o->fuse_uring, mode) << text;
  }
}

TEST(FuseOptions, PassthroughIsAutoUnlessTurnedOff) {
  auto d = parse({"img", "mnt"});
  ASSERT_TRUE(d);
  EXPECT_TRUE(d->passthrough);
  auto off = parse({"-o", "passthrough=off", "img", "mnt"});
  ASSERT_TRUE(off) << off.status().to_string();
  EXPECT_FALSE(off->passthrough);
  auto on = parse({"-o", "passthrough=off,passthrough=auto", "img", "mnt"});
  ASSERT_TRUE(on) << on.status().to_string();
  EXPECT_TRUE(on->passthrough);
}

// The kernel keeps one FUSE ring queue per possible CPU: at least the online ones.
TEST(FuseOptions, PossibleCpusCoverTheOnlineOnes) {
  EXPECT_GE(possible_cpu_count(), static_cast<unsigned>(sysconf(_SC_NPROCESSORS_ONLN)));
}

TEST(FuseOptions, DefaultQueueCountIsBounded) {
  unsigned n = default_queue_count();
  EXPECT_GE(n, 1u);
  EXPECT_LE(n, kMaxDefaultQueues);
}

TEST(FuseOptions, UsageListsEveryOption) {
  std::string u = usage_text("qcowfs");
  for (const char* opt : {"ro", "rw", "cache=", "aio=", "queues=", "format=", "discard=", "snapshot=",
                          "l2_cache_size=", "table_cache_size=", "fuse_uring=", "passthrough=", "allow_other", "uid=", "gid=", "umask=",
                          "fmask=", "dmask=", "-f", "-d", "--help", "--version", "throwaway", "status-file=", "idle-timeout=", "SRCDIR"})
    EXPECT_NE(u.find(opt), std::string::npos) << opt;
}

TEST(FuseOptions, IdleTimeoutInSecondsWithFractions) {
  auto d = parse({"dir", "/mnt"});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->idle_timeout, kDefaultIdleTimeout);
  auto o = parse({"-o", "idle-timeout=0.25", "dir", "/mnt"});
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->idle_timeout, std::chrono::milliseconds(250));
  for (const char* bad : {"idle-timeout=-1", "idle-timeout=x", "idle-timeout=", "idle-timeout=1e9"}) {
    auto b = parse({"-o", bad, "dir", "/mnt"});
    EXPECT_FALSE(b) << bad;
  }
}

TEST(FuseOptions, StatusFile) {
  std::vector<std::string> args = {"https://h/a.qcow2", "/mnt", "-o", "status-file=/run/a.json"};
  auto o = parse_command_line(args);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->status_file, "/run/a.json");
  std::vector<std::string> empty = {"https://h/a.qcow2", "/mnt", "-o", "status-file="};
  EXPECT_FALSE(parse_command_line(empty).is_ok());
}

TEST(MountHelperOptions, FstabAtimeFlagsAreAccepted) {
  // mount(8) hands fstab options such as "defaults,noatime" to the helper.
  std::vector<std::string> args = {"disk.qcow2", "/mnt", "-o", "rw,defaults,noatime,nodiratime,relatime,_netdev"};
  auto o = parse_command_line(args);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_TRUE(o->writable());
  std::vector<std::string> bad = {"disk.qcow2", "/mnt", "-o", "noatimes"};
  EXPECT_FALSE(parse_command_line(bad).is_ok());
}

}  // namespace
}  // namespace qcowfs::fuse
