// A new LUKS1 header for `qcowfs create`, shared by the formats that make one
// (-f luks, and qcow2's -o encrypt.format=luks): the passphrase from the key
// file or the terminal, the header formatted with it, and the LUKS part of
// qemu-img's "Formatting" line.
// Thread-safety: free functions; the terminal prompt belongs to one thread.
#pragma once

#include <string>
#include <string_view>

#include "image/crypto/luks.h"
#include "image/crypto/luks_create.h"
#include "io/status.h"

namespace qcowfs::image {

// Formats a LUKS1 header for o, its passphrase read from o.key_file or asked
// on the terminal. image names the new image; key_option is the option that
// gives the key file ("key-file", "encrypt.key-file"), named in the ENOKEY
// message when there is neither a key file nor a terminal.
Result<crypto::LuksFormatted> format_new_luks(const LuksCreateOptions& o, const std::string& image,
                                              std::string_view key_option);

// qemu-img's " encrypt.format=luks encrypt.key-secret=..." part of the
// Formatting line: the options given that differ from the defaults, each
// " PREFIXkey=value" (prefix "" for -f luks, "encrypt." for qcow2).
std::string luks_formatting(const LuksCreateOptions& o, std::string_view prefix);

}  // namespace qcowfs::image
