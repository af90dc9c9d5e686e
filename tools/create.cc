// qcowfs create: makes a new image with qemu-img create's command line: -f
// names the format (qcow2 by default), -o takes qemu-img's option names, -b/-F
// name the backing file. The format checks its options and writes the image
// through the registry (image/format.h, image/create.h); this file only opens
// the backing file, locks the files and prints the "Formatting" line.
// Encrypted images take the passphrase from a key file (in place of QEMU's
// secret objects) or the terminal; it is asked once every file is
// write-locked (as QEMU locks images): an image in use is refused at once and
// left as it was, and a failed create removes the files it made.
// Like qemu-img 7.2 it refuses a backing file without its format (-F or
// backing_fmt): the format is written into the image, and a probed one lets a
// raw backing file that starts like a qcow2 header pass itself off as one.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <optional>

#include "image/block_driver.h"
#include "image/create.h"
#include "image/format.h"
#include "image/path.h"
#include "io/fd.h"
#include "io/lock.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

struct CreateArgs {
  std::string image;
  std::string format{image::default_create_format()};
  std::string option_list;  // -o lists, joined with commas
  std::string backing, backing_format;
  std::string size;
  bool quiet = false;
  bool unsafe = false;  // -u: do not open the backing file
  bool help = false;
};

Status check_create_format(std::string_view v) {
  const image::FormatInfo* f = image::find_format(v);
  if (f && f->prepare_create) return Status::ok();
  if (f) return Status::errorf(EINVAL, "Format driver '{}' does not support image creation", v);
  return Status::errorf(EINVAL, "unknown format '{}' ({})", v, image::creatable_format_names());
}

// The command line; errors are usage errors. With --help nothing but the flags is looked at.
Result<CreateArgs> parse_create_args(std::span<const std::string> args) {
  CreateArgs a;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (args[i] == "-h" || args[i] == "--help") {
      a.help = true;
    } else if (args[i] == "-q" || args[i] == "--quiet") {
      a.quiet = true;
    } else if (args[i] == "-u") {
      a.unsafe = true;
    } else if (take_option(args, i, "--options", "-o", v)) {
      a.option_list += (a.option_list.empty() ? "" : ",") + v;
    } else if (take_option(args, i, "--backing", "-b", v)) {
      a.backing = v;
    } else if (take_option(args, i, "--backing-format", "-F", v)) {
      a.backing_format = v;
    } else if (take_option(args, i, "--format", "-f", v)) {
      QCOWFS_TRY(check_create_format(v));
      a.format = v;
    } else if (args[i].size() > 1 && args[i][0] == '-') {
      return Status::errorf(EINVAL, "unknown option '{}'", args[i]);
    } else {
      positional.push_back(args[i]);
    }
  }
  if (a.help) return a;
  if (positional.empty()) return Status::error(EINVAL, "missing IMAGE");
  if (positional.size() > 2) return Status::errorf(EINVAL, "unexpected argument '{}'", positional[2]);
  a.image = positional[0];
  if (positional.size() == 2) a.size = positional[1];
  return a;
}

// qemu-img's refusal of a backing file without a format; `detected` is the
// probed format when the backing file was opened.
Status missing_backing_format(const std::string& image, std::string_view detected) {
  std::string msg = fmt::format("{}: Backing file specified without backing format", image);
  if (!detected.empty()) msg += fmt::format("\nDetected format of {}.", detected);
  return Status::error(EINVAL, std::move(msg));
}

// Opens the backing file (as qemu-img does, unless -u): it must open with the
// format given, and its size is the default image size (r.size is set to it
// when no size was given).
Task<Status> inspect_backing_file(const CreateArgs& a, image::CreateRequest& r) {
  if (a.unsafe) {
    if (r.backing_format.empty()) co_return missing_backing_format(a.image, "");
    if (!r.size) co_return Status::errorf(EINVAL, "{}: Image creation needs a size parameter", a.image);
    co_return Status::ok();
  }
  image::ImageOptions bo;
  bo.format = r.backing_format;
  auto b = co_await image::open_image(image::resolve_relative(a.image, r.backing_file), bo);
  if (!b) co_return b.status().with_context(fmt::format("could not open backing file '{}'", r.backing_file));
  std::string detected((*b)->format_name());
  uint64_t backing_size = (*b)->size();
  QCOWFS_CO_TRY(co_await (*b)->close());
  if (r.backing_format.empty()) co_return missing_backing_format(a.image, detected);
  if (!r.size) r.size = backing_size;
  co_return Status::ok();
}

// The files a create makes. Each is first write-locked (lock(), for every
// file before any is emptied), as QEMU's raw_co_create does: a file another
// process uses (a mount, qemu-io, a VM) is refused and left byte-identical.
// create() then empties and opens it, holding that lock. Unless the create
// succeeded, the files it made or emptied are removed again (no half-made
// image is left behind); files it only locked are left alone.
class CreatedFiles {
 public:
  CreatedFiles() = default;
  CreatedFiles(const CreatedFiles&) = delete;
  CreatedFiles& operator=(const CreatedFiles&) = delete;
  ~CreatedFiles() {
    if (!done_)
      for (const Entry& e : files_)
        if (e.touched) ::unlink(e.path.c_str());
  }

  // Takes path's write lock, creating the file (empty) when it is missing.
  Status lock(const std::string& path) {
    io::UniqueFd made(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0644));
    const bool created = made.valid();
    if (!created && errno != EEXIST) return Status::from_errno(errno, fmt::format("creating {}", path));
    // The write lock of a mount or QEMU writer (QEMU's raw_co_create takes the
    // same perms on an existing file before it truncates it).
    auto l = io::ImageLock::acquire(path, io::LockPerms::for_image(true, false), io::LockMode::automatic);
    if (!l) {
      if (created) ::unlink(path.c_str());
      return l.status();
    }
    files_.push_back(Entry{path, std::move(*l), created});
    return Status::ok();
  }

  // Empties path (locked by lock()) and opens it writable, holding its lock.
  Result<std::unique_ptr<io::HostFile>> create(const std::string& path) {
    Entry* e = find(path);
    if (e == nullptr) return Status::errorf(EINVAL, "{}: creating a file that was not locked first", path);
    e->touched = true;
    io::OpenOptions o;
    o.locking = io::LockMode::off;  // e->lock is the lock
    auto f = io::create_host_file(path, o);
    if (f) (*f)->hold_lock(std::move(e->lock));
    return f;
  }

  Status finish(Status st) {
    done_ = st.is_ok();
    return st;
  }

 private:
  struct Entry {
    std::string path;
    io::ImageLock lock;
    bool touched = false;  // made or emptied by this create
  };
  Entry* find(const std::string& path) {
    for (Entry& e : files_)
      if (e.path == path) return &e;
    return nullptr;
  }
  std::vector<Entry> files_;
  bool done_ = false;
};

// The -o list as key=value pairs, in order.
Result<std::vector<std::pair<std::string, std::string>>> split_options(std::string_view list) {
  std::vector<std::pair<std::string, std::string>> out;
  while (!list.empty()) {
    const size_t comma = list.find(',');
    const std::string_view opt = list.substr(0, comma);
    const size_t eq = opt.find('=');
    if (eq == std::string_view::npos) return Status::errorf(EINVAL, "option '{}' needs a value (key=value)", opt);
    out.emplace_back(std::string(opt.substr(0, eq)), std::string(opt.substr(eq + 1)));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return out;
}

Result<image::CreateRequest> build_request(const CreateArgs& a) {
  image::CreateRequest r;
  r.path = a.image;
  auto options = split_options(a.option_list);
  if (!options) return options.status();
  r.options = std::move(*options);
  if (auto v = image::take_create_option(r.options, "size")) {
    auto n = image::parse_create_size("size", *v);
    if (!n) return n.status();
    r.size = *n;
  }
  if (!a.size.empty()) {
    auto n = image::parse_create_size("size", a.size);
    if (!n) return n.status();
    r.size = *n;
  }
  if (auto v = image::take_create_option(r.options, "backing_file")) r.backing_file = *v;
  if (auto v = image::take_create_option(r.options, "backing_fmt")) r.backing_format = *v;
  if (!a.backing.empty()) r.backing_file = a.backing;
  if (!a.backing_format.empty()) r.backing_format = a.backing_format;
  return r;
}

// image::NewFiles over CreatedFiles: every file made is removed if the create fails.
class RegistryNewFiles final : public image::NewFiles {
 public:
  explicit RegistryNewFiles(CreatedFiles& files) : files_(files) {}
  Result<io::HostFile*> create(const std::string& path) override {
    auto f = files_.create(path);
    if (!f) return f.status();
    open_.push_back(std::move(*f));
    return open_.back().get();
  }

 private:
  CreatedFiles& files_;
  std::vector<std::unique_ptr<io::HostFile>> open_;
};

// The format prepares (options checked, nothing touched); every file is
// locked; the creator asks for its secrets; the Formatting line; the write.
Task<Status> create_image(const CreateArgs& a) {
  const image::FormatInfo* f = image::find_format(a.format);
  auto request = build_request(a);
  if (!request) co_return request.status();
  if (!request->backing_file.empty()) QCOWFS_CO_TRY(co_await inspect_backing_file(a, *request));
  auto creator = f->prepare_create(*request);
  if (!creator) co_return creator.status();
  CreatedFiles files;
  for (const std::string& path : (*creator)->extra_paths()) QCOWFS_CO_TRY(files.lock(path));
  QCOWFS_CO_TRY(files.lock(a.image));
  QCOWFS_CO_TRY((*creator)->ask_secrets());
  if (!a.quiet) fmt::print("Formatting '{}', {}\n", a.image, (*creator)->formatting());
  std::fflush(stdout);
  Status st;
  {
    RegistryNewFiles new_files(files);
    st = co_await (*creator)->write(new_files);
  }
  co_return files.finish(std::move(st));
}

}  // namespace

std::string_view create_usage() {
  return "usage: qcowfs create [-f FORMAT] [-o OPTIONS] [-b BACKING -F BACKING_FMT [-u]] [-q] IMAGE [SIZE]\n"
         "\n"
         "Creates a qcow2 v3 image (a raw one with -f raw, raw LUKS1 with -f luks,\n"
         "VMDK, VHD (vpc), QED, VDI, Parallels or VHDX with -f, laid out as qemu-img 7.2 does).\n"
         "SIZE takes K, M, G, T suffixes; with a backing file it defaults to the\n"
         "backing file's size. A backing file needs its format (-F), as with\n"
         "qemu-img 7.2. An encrypted image's passphrase is the key file's whole\n"
         "content (- reads standard input); without one it is asked on the terminal.\n"
         "\n"
         "  -f, --format=FMT          qcow2 (default), raw, luks, vmdk, vpc, qed, vdi, parallels, vhdx\n"
         "  -o, --options=OPTS        comma-separated qemu-img options (below)\n"
         "  -b, --backing=FILE        backing file (relative names: to IMAGE's directory)\n"
         "  -F, --backing-format=FMT  backing file format (required with -b)\n"
         "  -u                        do not open the backing file (SIZE is then required)\n"
         "  -q, --quiet               do not print the 'Formatting' line\n"
         "  -h, --help                show this text\n"
         "\n"
         "options (-o):\n"
         "  size=SIZE                 virtual disk size\n"
         "  cluster_size=SIZE         512 to 2M, a power of two (default 64K)\n"
         "  compat=0.10|1.1           qcow2 version 2 or 3 (default 1.1)\n"
         "  refcount_bits=N           1, 2, 4, 8, 16 (default), 32 or 64\n"
         "  lazy_refcounts=on|off     lazy refcounts (compat=1.1)\n"
         "  extended_l2=on|off        subclusters (compat=1.1, clusters of 16K or more)\n"
         "  compression_type=zlib|zstd\n"
         "  preallocation=off|metadata|falloc|full\n"
         "  data_file=FILE            keep guest data in an external data file\n"
         "  data_file_raw=on|off      the data file is a raw image of the disk\n"
         "  backing_file=FILE         same as -b\n"
         "  backing_fmt=FMT           same as -F\n"
         "  encrypt.format=luks       encrypt with LUKS1 (legacy AES, encryption=on, is refused)\n"
         "  encrypt.key-file=PATH     the passphrase (- for standard input; default: ask)\n"
         "  encrypt.cipher-alg=ALG    aes-128|aes-192|aes-256 (default)|serpent-N|twofish-N|cast5-128\n"
         "  encrypt.cipher-mode=MODE  xts (default), cbc, ecb or ctr\n"
         "  encrypt.ivgen-alg=ALG     plain64 (default), plain or essiv\n"
         "  encrypt.ivgen-hash-alg=H  essiv's hash (default sha256)\n"
         "  encrypt.hash-alg=H        PBKDF2 hash: sha256 (default), sha1, sha512, ...\n"
         "  encrypt.iter-time=MS      PBKDF2 time for the key slot (default 2000)\n"
         "\n"
         "options (-o) with -f luks: size=SIZE and the encrypt.* options above without\n"
         "the prefix (key-file=PATH, cipher-alg=ALG, ..., iter-time=MS).\n"
         "\n"
         "options (-o) with -f vmdk (a -F vmdk backing file makes a delta disk):\n"
         "  subformat=SUB             monolithicSparse (default), monolithicFlat,\n"
         "                            twoGbMaxExtentSparse, twoGbMaxExtentFlat, streamOptimized\n"
         "  adapter_type=TYPE         ide (default), lsilogic, buslogic or legacyESX\n"
         "  hwversion=N, toolsversion=N, compat6=on|off, zeroed_grain=on|off\n"
         "  preallocation=off|falloc|full (accepted; no effect)\n"
         "\n"
         "options (-o) with -f vpc (VHD):\n"
         "  subformat=dynamic|fixed   dynamic (default) or fixed\n"
         "  force_size=on|off         keep the exact size (default: rounded up to a CHS geometry)\n"
         "  preallocation=off|falloc|full (accepted; no effect)\n"
         "\n"
         "options (-o) of the other formats (besides size=):\n"
         "  qed:       cluster_size=SIZE (4K to 64M, a power of two, default 64K),\n"
         "             table_size=N (L1/L2 tables in clusters: 1 to 16, a power of two,\n"
         "             default 4), backing_file=FILE, backing_fmt=FMT (or -b, -F)\n"
         "  vdi:       static=on|off (preallocated blocks; default off)\n"
         "  parallels: cluster_size=SIZE (default 1M)\n"
         "  vhdx:      subformat=dynamic|fixed (default dynamic), block_size=SIZE (1M\n"
         "             to 256M; 0, the default, chooses 8M to 64M from the size),\n"
         "             log_size=SIZE (default 1M), block_state_zero=on|off (default on)\n";
}

int cmd_create(std::span<const std::string> args) {
  return run_tool("create", create_usage(), parse_create_args(args), [](const CreateArgs& a, io::Engine& engine) {
    Status st = io::run_sync(engine, create_image(a));
    return st ? 0 : cmd_fail("create", st);
  });
}

}  // namespace qcowfs::tools
