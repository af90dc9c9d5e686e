// qcowfs create: makes a new qcow2, raw or LUKS image, with qemu-img create's
// command line: -o takes qemu-img's option names, -b/-F name the backing file.
// Encrypted images (qcow2 -o encrypt.format=luks, -f luks) take the passphrase
// from a key file (encrypt.key-file / key-file, in place of QEMU's secret
// objects) or the terminal; it is read before any existing file is changed,
// and a failed create removes the files it made. Every file is write-locked
// first (as QEMU locks images, before the passphrase is asked): an image in
// use is refused at once and left as it was.
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
#include "image/crypto/luks.h"
#include "image/crypto/secret.h"
#include "image/luks/luks.h"
#include "image/path.h"
#include "image/qcow2/qcow2_create.h"
#include "image/raw/raw.h"
#include "io/fd.h"
#include "io/lock.h"
#include "tools/cmd.h"

namespace qcowfs::tools {
namespace {

namespace q = image::qcow2;

struct CreateArgs {
  std::string image;
  std::string format = "qcow2";
  std::string option_list;  // -o lists, joined with commas
  std::string backing, backing_format;
  std::string size;
  bool quiet = false;
  bool unsafe = false;  // -u: do not open the backing file
  bool help = false;
  q::CreateOptions create_options;  // the above as qcow2 create options (not with help)
  image::LuksCreateOptions luks;    // -f luks: the -o list as LUKS options
};

// The formats create makes itself (their options are qcow2's create options)
// rather than through the registry's PrepareCreateFn.
bool is_builtin_format(std::string_view f) { return f == "qcow2" || f == "raw" || f == "luks"; }

std::string creatable_format_names() {
  std::string names = "qcow2, raw, luks";
  for (const image::FormatInfo& f : image::all_formats())
    if (f.prepare_create && !is_builtin_format(f.name)) names += fmt::format(", {}", f.name);
  return names;
}

Status check_create_format(std::string_view v) {
  if (is_builtin_format(v)) return Status::ok();
  const image::FormatInfo* f = image::find_format(v);
  if (f && f->prepare_create) return Status::ok();
  if (f) return Status::errorf(EINVAL, "Format driver '{}' does not support image creation", v);
  return Status::errorf(EINVAL, "unknown format '{}' ({})", v, creatable_format_names());
}

Result<CreateArgs> parse_create_flags(std::span<const std::string> args) {
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

// -f luks: size= and the LUKS options by their unprefixed names, as qemu-img create -f luks.
Status apply_luks_options(CreateArgs& a, q::CreateOptions& o) {
  for (std::string_view list = a.option_list; !list.empty();) {
    const size_t comma = list.find(',');
    const std::string_view opt = list.substr(0, comma);
    const size_t eq = opt.find('=');
    if (eq == std::string_view::npos) return Status::errorf(EINVAL, "option '{}' needs a value (key=value)", opt);
    const std::string_view key = opt.substr(0, eq), value = opt.substr(eq + 1);
    if (key == "size")
      QCOWFS_TRY(q::apply_create_option(o, key, value));
    else
      QCOWFS_TRY(image::apply_luks_create_option(a.luks, key, value));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return Status::ok();
}

Result<q::CreateOptions> build_options(CreateArgs& a) {
  q::CreateOptions o;
  if (!is_builtin_format(a.format)) return o;  // the format parses its own (create_through_registry)
  if (a.format == "luks")
    QCOWFS_TRY(apply_luks_options(a, o));
  else
    QCOWFS_TRY(q::apply_create_options(o, a.option_list));
  if (!a.size.empty()) QCOWFS_TRY(q::apply_create_option(o, "size", a.size));
  if (!a.backing.empty()) o.backing_file = a.backing;
  if (!a.backing_format.empty()) o.backing_format = a.backing_format;
  return o;
}

// The command line, its -o/-b/-F/SIZE turned into create options; errors are
// usage errors. With --help nothing but the flags is looked at.
Result<CreateArgs> parse_create_args(std::span<const std::string> args) {
  auto a = parse_create_flags(args);
  if (!a || a->help) return a;
  auto o = build_options(*a);
  if (!o) return o.status();
  a->create_options = std::move(*o);
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
// format given, and its size is the default image size. `size` is the size
// given, if any; it is set to the backing file's when not.
Task<Status> inspect_backing_file(const CreateArgs& a, const std::string& file, const std::string& format,
                                  std::optional<uint64_t>& size) {
  if (file.empty()) co_return Status::ok();
  if (a.unsafe) {
    if (format.empty()) co_return missing_backing_format(a.image, "");
    if (!size) co_return Status::errorf(EINVAL, "{}: Image creation needs a size parameter", a.image);
    co_return Status::ok();
  }
  image::ImageOptions bo;
  bo.format = format;
  auto b = co_await image::open_image(image::resolve_relative(a.image, file), bo);
  if (!b) co_return b.status().with_context(fmt::format("could not open backing file '{}'", file));
  std::string detected((*b)->format_name());
  uint64_t backing_size = (*b)->size();
  QCOWFS_CO_TRY(co_await (*b)->close());
  if (format.empty()) co_return missing_backing_format(a.image, detected);
  if (!size) size = backing_size;
  co_return Status::ok();
}

// inspect_backing_file() for qcow2's create options.
Task<Status> inspect_backing(const CreateArgs& a, q::CreateOptions& o) {
  std::optional<uint64_t> size;
  if (o.size_given) size = o.size;
  QCOWFS_CO_TRY(co_await inspect_backing_file(a, o.backing_file, o.backing_format, size));
  if (size) {
    o.size = *size;
    o.size_given = true;
  }
  co_return Status::ok();
}

// QEMU's "encrypt.format=luks encrypt.key-secret=..." part: the LUKS options that differ from the defaults.
std::string luks_formatting(const image::LuksCreateOptions& l, std::string_view prefix) {
  const image::LuksCreateOptions d;
  std::string s;
  auto add = [&](std::string_view key, const auto& v, bool given) {
    if (given) s += fmt::format(" {}{}={}", prefix, key, v);
  };
  add("key-file", l.key_file, !l.key_file.empty());
  add("cipher-alg", l.cipher_alg, l.cipher_alg != d.cipher_alg);
  add("cipher-mode", l.cipher_mode, l.cipher_mode != d.cipher_mode);
  add("ivgen-alg", l.ivgen_alg, l.ivgen_alg != d.ivgen_alg);
  add("ivgen-hash-alg", l.ivgen_hash_alg, !l.ivgen_hash_alg.empty());
  add("hash-alg", l.hash_alg, l.hash_alg != d.hash_alg);
  add("iter-time", l.iter_time_ms, l.iter_time_ms != d.iter_time_ms);
  return s;
}

void print_formatting(const CreateArgs& a, const q::CreateOptions& o) {
  if (a.format == "raw" || a.format == "luks") {
    fmt::print("Formatting '{}', fmt={} size={}{}\n", a.image, a.format, o.size,
               a.format == "luks" ? luks_formatting(a.luks, "") : "");
    return;
  }
  fmt::print("Formatting '{}', fmt=qcow2", a.image);
  if (o.encrypt) fmt::print(" encrypt.format=luks{}", luks_formatting(o.luks, "encrypt."));
  fmt::print(" cluster_size={} extended_l2={} compression_type={} size={}", o.cluster_size,
             o.extended_l2 ? "on" : "off", o.compression_type ? "zstd" : "zlib", o.size);
  if (!o.backing_file.empty()) fmt::print(" backing_file={}", o.backing_file);
  if (!o.backing_format.empty()) fmt::print(" backing_fmt={}", o.backing_format);
  if (!o.data_file.empty()) fmt::print(" data_file={} data_file_raw={}", o.data_file, o.data_file_raw ? "on" : "off");
  fmt::print(" lazy_refcounts={} refcount_bits={}", o.lazy_refcounts ? "on" : "off", o.refcount_bits);
  if (o.preallocation != q::Preallocation::off) fmt::print(" preallocation={}", q::to_string(o.preallocation));
  fmt::print("\n");
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

// A new LUKS1 header for the image, its passphrase from the key file or the terminal (before any file exists).
Result<image::crypto::LuksFormatted> format_new_luks(const image::LuksCreateOptions& l, const std::string& image,
                                                     std::string_view key_option) {
  auto params = image::luks_format_params(l);
  if (!params) return params.status();
  auto keys = l.key_file.empty() ? image::crypto::KeyProvider::from_terminal()
                                 : image::crypto::KeyProvider::from_file(l.key_file);
  auto pass = keys->passphrase(image);
  if (!pass && pass.status().code() == ENOKEY)
    return Status::errorf(ENOKEY,
                          "{}: the new image is encrypted: give its passphrase with -o {}=PATH ({}=- for "
                          "standard input), or run on a terminal to be asked",
                          image, key_option, key_option);
  if (!pass) return pass.status();
  return image::crypto::format_luks1(*params, (*pass)->span());
}

Task<Status> create_raw_file(const std::string& path, const q::CreateOptions& o) {
  CreatedFiles files;
  QCOWFS_CO_TRY(files.lock(path));
  auto f = files.create(path);
  if (!f) co_return f.status();
  bool allocate = o.preallocation == q::Preallocation::falloc || o.preallocation == q::Preallocation::full;
  co_return files.finish(co_await image::create_raw(**f, o.size, allocate));
}

// The files are locked before the passphrase is asked (and its PBKDF2 run),
// so an image in use is refused at once, as qemu-img create does.
Task<Status> create_luks_file(const CreateArgs& a, const q::CreateOptions& o) {
  CreatedFiles files;
  QCOWFS_CO_TRY(files.lock(a.image));
  auto luks = format_new_luks(a.luks, a.image, "key-file");
  if (!luks) co_return luks.status();
  if (!a.quiet) print_formatting(a, o);
  auto f = files.create(a.image);
  if (!f) co_return f.status();
  co_return files.finish(co_await image::create_luks(**f, *luks, o.size));
}

Task<Status> create_qcow2(const CreateArgs& a, q::CreateOptions o) {
  const std::string& path = a.image;
  QCOWFS_CO_TRY(co_await inspect_backing(a, o));
  auto valid = q::validate_create_options(std::move(o));
  if (!valid) co_return valid.status();
  CreatedFiles files;
  const std::string data_path =
      valid->data_file.empty() ? std::string() : image::resolve_relative(path, valid->data_file);
  if (!data_path.empty()) QCOWFS_CO_TRY(files.lock(data_path));
  QCOWFS_CO_TRY(files.lock(path));
  image::crypto::LuksFormatted luks;
  if (valid->encrypt) {
    auto formatted = format_new_luks(valid->luks, path, "encrypt.key-file");
    if (!formatted) co_return formatted.status();
    luks = std::move(*formatted);
  }
  if (!a.quiet) print_formatting(a, *valid);
  std::unique_ptr<io::HostFile> data;
  if (!data_path.empty()) {
    auto d = files.create(data_path);
    if (!d) co_return d.status();
    data = std::move(*d);
  }
  auto f = files.create(path);
  if (!f) co_return f.status();
  co_return files.finish(co_await q::write_new_image(**f, data.get(), *valid, luks.header));
}

// ---- every other format: through the registry (image/create.h) ----

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

// inspect_backing_file() for a registry format's request.
Task<Status> inspect_request_backing(const CreateArgs& a, image::CreateRequest& r) {
  co_return co_await inspect_backing_file(a, r.backing_file, r.backing_format, r.size);
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

Task<Status> create_through_registry(const CreateArgs& a) {
  const image::FormatInfo* f = image::find_format(a.format);
  auto request = build_request(a);
  if (!request) co_return request.status();
  if (!request->backing_file.empty() || !request->backing_format.empty())
    QCOWFS_CO_TRY(co_await inspect_request_backing(a, *request));
  auto creator = f->prepare_create(*request);
  if (!creator) co_return creator.status();
  if (!a.quiet) fmt::print("Formatting '{}', {}\n", a.image, (*creator)->formatting());
  std::fflush(stdout);
  CreatedFiles files;
  for (const std::string& path : (*creator)->extra_paths()) QCOWFS_CO_TRY(files.lock(path));
  QCOWFS_CO_TRY(files.lock(a.image));
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
    if (!is_builtin_format(a.format)) {
      Status st = io::run_sync(engine, create_through_registry(a));
      return st ? 0 : cmd_fail("create", st);
    }
    const q::CreateOptions& o = a.create_options;
    if (a.format == "raw" && !o.backing_file.empty())
      return cmd_fail("create",
                      Status::errorf(EINVAL, "{}: Backing file not supported for file format 'raw'", a.image));
    if (a.format == "raw" && (o.encrypt || o.encrypt_options_given))
      return usage_error("create", "a raw image cannot be encrypted (use -f luks)");
    if (a.format == "raw" && !o.size_given) return usage_error("create", "a raw image needs a SIZE");
    if (a.format == "luks" && !o.backing_file.empty())
      return cmd_fail("create",
                      Status::errorf(EINVAL, "{}: Backing file not supported for file format 'luks'", a.image));
    if (a.format == "luks" && !o.size_given) return usage_error("create", "a LUKS image needs a SIZE");
    if (a.format == "raw" && !a.quiet) print_formatting(a, o);
    Status st = a.format == "raw"    ? io::run_sync(engine, create_raw_file(a.image, o))
                : a.format == "luks" ? io::run_sync(engine, create_luks_file(a, o))
                                     : io::run_sync(engine, create_qcow2(a, o));
    if (!st) return cmd_fail("create", st);
    return 0;
  });
}

}  // namespace qcowfs::tools
