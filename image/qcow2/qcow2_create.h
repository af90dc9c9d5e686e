// Creating new qcow2 images (`qcowfs create`): options named as qemu-img
// names them, validated with qemu's rules, and a writer that lays out a fresh
// image in files the caller has created and opened:
//
//   cluster 0                header (+ extensions, backing file name)
//   next T clusters          refcount table
//   next B clusters          refcount blocks (covering every cluster below)
//   next L clusters          L1 table (exactly the entries the size needs)
//   encrypted only:          the LUKS area (header and key material) in whole
//                            clusters, as QEMU's qcow2_set_up_encryption places it
//   preallocation only:      every L2 table, then every data cluster in guest
//                            order (data clusters go to the external data file
//                            at their guest offset when there is one)
//
// Thread-safety: pure functions and one coroutine writing files it is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "image/create.h"
#include "image/crypto/luks_create.h"
#include "image/qcow2/header.h"
#include "io/host_file.h"
#include "io/status.h"
#include "io/task.h"

namespace qcowfs::image::qcow2 {

enum class Preallocation { off, metadata, falloc, full };

struct CreateOptions {
  uint64_t size = 0;            // guest bytes (rounded up to 512 when validated)
  bool size_given = false;      // false: take the backing file's size
  uint64_t cluster_size = 65536;
  bool compat_v2 = false;       // compat=0.10 (qcow2 version 2)
  uint32_t refcount_bits = 16;
  bool lazy_refcounts = false;
  bool extended_l2 = false;
  uint8_t compression_type = kCompressionZlib;
  Preallocation preallocation = Preallocation::off;
  std::string data_file;        // external data file name, as stored in the header
  bool data_file_raw = false;
  std::string backing_file;     // as stored in the header
  std::string backing_format;
  // encrypt.format=luks: LUKS1 in the image (crypt_method 2); encrypt.* are its
  // options by QEMU's names (encrypt.cipher-alg, ...; encrypt.key-file is ours).
  bool encrypt = false;
  bool encrypt_options_given = false;  // some encrypt.* besides encrypt.format
  LuksCreateOptions luks;
};

// Applies one qemu-img style option (key=value; "on"/"off" for booleans).
Status apply_create_option(CreateOptions& o, std::string_view key, std::string_view value);
// Applies a comma-separated list of them, left to right.
Status apply_create_options(CreateOptions& o, std::string_view list);

// Checks the combination (qemu's rules: compat=0.10 excludes v3 features,
// extended_l2 needs 16 KiB clusters, backing files exclude data_file_raw and
// need extended_l2 to be preallocated, ...) and normalises it (size rounded
// up to 512 bytes; data_file_raw implies metadata preallocation).
Result<CreateOptions> validate_create_options(CreateOptions o);

// The header a validated CreateOptions describes, before layout (offsets unset).
Header create_header(const CreateOptions& o);

// Writes a complete image into `file` (empty, writable) for validated options;
// `data_file` is the external data file when o.data_file is set (else null).
// luks_area: with o.encrypt, the LUKS header and key material (format_luks1's
// header, payload_offset bytes): written after the L1 table in whole clusters,
// named by the crypto header extension {offset, luks_area.size()}.
Task<Status> write_new_image(io::HostFile& file, io::HostFile* data_file, const CreateOptions& o,
                             std::span<const std::byte> luks_area = {});

std::string_view to_string(Preallocation p);

// `qcowfs create -f qcow2`, the registry's PrepareCreateFn (image/create.h):
// the request's options as apply_create_option takes them, its size and
// backing file, validated; the external data file is the creator's extra
// path, an encrypted image's passphrase is asked in ask_secrets().
Result<std::unique_ptr<Creator>> prepare_qcow2_create(const CreateRequest& request);

}  // namespace qcowfs::image::qcow2
