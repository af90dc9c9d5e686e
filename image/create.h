// Creating an image: what `qcowfs create` (tools/create.cc) asks of a format,
// format-neutral. A format that can make new images offers the registry
// (image/format.h) a PrepareCreateFn; tools/ parses qemu-img create's command
// line into a CreateRequest, opens the backing file if one is named, asks the
// format to prepare (options checked, no file touched), locks the image and
// every extra path, lets the creator ask for its secrets, prints the
// creator's "Formatting" line, and lets it write through NewFiles, which
// creates each (locked) file and removes every file it made if the create
// fails.
//
// Thread-safety: a Creator is used by one thread, once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "io/buffer.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image {

// qemu-img create's arguments. Generic parts are taken out of the -o list:
// size=, backing_file= and backing_fmt= land in the fields; everything else
// stays in `options` for the format, in the order given.
struct CreateRequest {
  std::string path;                  // the new image, as the user named it
  std::optional<uint64_t> size;      // SIZE or size=; with a backing file, its size when not given
  std::string backing_file;          // -b or backing_file= ("" for none)
  std::string backing_format;        // -F or backing_fmt=
  std::vector<std::pair<std::string, std::string>> options;  // -o key=value, not yet consumed
};

// Makes the files of one new image. Every file made through it is removed
// again unless the create succeeds; a file that exists is taken over (locked
// first, then truncated: never truncated while another process holds it).
class NewFiles {
 public:
  virtual ~NewFiles() = default;
  // Creates (or takes over) path, opened read-write and locked as QEMU locks
  // an image it writes; path must be the image or one of the creator's
  // extra_paths(), locked before write() began. The file lives as long as
  // this NewFiles.
  virtual Result<io::HostFile*> create(const std::string& path) = 0;
};

// One prepared create: options checked and resolved.
class Creator {
 public:
  virtual ~Creator() = default;
  // What qemu-img prints after "Formatting 'IMAGE', ": "fmt=vmdk size=1073741824
  // compat6=off hwversion=undefined" (the format's options in qemu-img's order).
  virtual std::string formatting() const = 0;
  // The files write() makes besides the image itself (VMDK extents, external
  // data files). The caller locks the image and each of these before write()
  // empties any, so a file another process uses fails the create untouched.
  virtual std::vector<std::string> extra_paths() const { return {}; }
  // Called once the image and every extra path are locked, before the
  // "Formatting" line: asks what the create needs from the user (an encrypted
  // image's passphrase, and runs its PBKDF2), so an image in use is refused
  // before anything is asked. Default: nothing to ask.
  virtual Status ask_secrets() { return Status::ok(); }
  // Writes the new image: the image file first through files.create(path),
  // then any further files (named by extra_paths()).
  virtual Task<Status> write(NewFiles& files) = 0;
};

// The image file of a format whose new image is its metadata `head` at offset
// 0 and zeros after it up to `length` bytes (left sparse): made through
// files.create(path), written, flushed.
Task<Status> write_new_image_file(NewFiles& files, const std::string& path, std::span<const std::byte> head,
                                  uint64_t length);

// The Creator of a format whose new image is one file written by
// write_new_image_file() (QED, VDI, Parallels): `formatting` is its
// Formatting line and `length` the file's size; make_head() builds the
// metadata when write() runs (so a create refused before it builds nothing),
// and its first head_bytes bytes are written (all of it when 0).
std::unique_ptr<Creator> new_image_file_creator(std::string path, std::string formatting, uint64_t length,
                                                std::function<io::AlignedBuffer()> make_head, size_t head_bytes = 0);

// Checks the request's options for one format and resolves defaults; an
// unknown option or a bad value is EINVAL with qemu-img's wording where it has
// one. No file is read or written here (the backing file was opened by the
// caller, which filled in request.size from it).
using PrepareCreateFn = Result<std::unique_ptr<Creator>> (*)(const CreateRequest& request);

// Takes the option `key` out of request.options (the last one given wins, as
// in qemu-img): its value, or nullopt when it was not given.
std::optional<std::string> take_create_option(std::vector<std::pair<std::string, std::string>>& options,
                                              std::string_view key);

// The first option left over, as qemu-img reports it: "Invalid parameter 'x'"
// (EINVAL); ok when none is left.
Status no_options_left(const std::vector<std::pair<std::string, std::string>>& options, std::string_view format);

// For a format without backing files: qemu-img's refusal of -b/backing_file
// ("IMAGE: Backing file not supported for file format 'vdi'") and of a lone
// backing_fmt ("Invalid parameter 'backing_fmt'"), EINVAL; ok without either.
Status no_backing_file(const CreateRequest& request, std::string_view format);

// "on"/"off" (and QEMU's other spellings of a bool) -> bool; otherwise
// qemu-img's "Parameter 'KEY' expects 'on' or 'off'" (EINVAL).
Result<bool> parse_create_bool(std::string_view key, std::string_view value);

// The request's size, or qemu-img's "IMAGE: Image creation needs a size
// parameter" (EINVAL) when neither SIZE, size= nor a backing file gave one.
Result<uint64_t> required_size(const CreateRequest& request);

// "64K", "1M", "1073741824" -> bytes (qemu-img's size suffixes k/K, M, G, T, P, E).
Result<uint64_t> parse_create_size(std::string_view key, std::string_view value);

}  // namespace qcowfs::image
