// The tests' name for io::ForwardingFile (io/forwarding_file.h): test files
// that observe or gate some calls derive from it and override only those.
// Thread-safety: that of the file it forwards to.
#pragma once

#include "io/forwarding_file.h"

namespace qcowfs::testing {

using io::ForwardingFile;

}  // namespace qcowfs::testing
