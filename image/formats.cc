// The format table (image/format.h). A new format adds its row here and its
// folder under image/.
#include <array>

#include "image/format.h"
#include "image/luks/luks.h"
#include "image/parallels/parallels.h"
#include "image/qcow2/qcow2.h"
#include "image/qed/qed.h"
#include "image/raw/raw.h"
#include "image/vdi/vdi.h"
#include "image/vdi/vdi_check.h"
#include "image/vhdx/vhdx.h"
#include "image/vhdx/vhdx_check.h"
#include "image/vmdk/vmdk.h"
#include "image/vmdk/vmdk_check.h"
#include "image/vpc/vpc.h"

namespace qcowfs::image {
namespace {

const std::array kFormats = {
    FormatInfo{"raw", "raw", open_raw},
    FormatInfo{.name = "qcow2", .display = "qcow2", .open = open_qcow2, .check = check_qcow2},
    FormatInfo{"qcow", "qcow (version 1)", nullptr},
    FormatInfo{.name = "vmdk", .display = "VMDK", .open = open_vmdk, .check = check_vmdk},
    FormatInfo{.name = "vhdx", .display = "VHDX", .open = open_vhdx, .check = check_vhdx},
    FormatInfo{"vpc", "VHD (vpc)", open_vpc},
    FormatInfo{.name = "vdi", .display = "VDI", .open = open_vdi, .check = check_vdi},
    FormatInfo{"qed", "QED", open_qed},
    FormatInfo{"parallels", "Parallels", open_parallels},
    FormatInfo{"luks", "LUKS", open_luks},
    FormatInfo{"bochs", "Bochs", nullptr},
    FormatInfo{"cloop", "cloop", nullptr},
    FormatInfo{"dmg", "DMG", nullptr},
};

}  // namespace

std::span<const FormatInfo> all_formats() { return kFormats; }

const FormatInfo* find_format(std::string_view name) {
  if (name == "vhd") name = "vpc";
  for (const FormatInfo& f : kFormats)
    if (f.name == name) return &f;
  return nullptr;
}

std::string supported_format_names() {
  std::string names;
  for (const FormatInfo& f : kFormats) {
    if (!f.supported()) continue;
    if (!names.empty()) names += ", ";
    names += f.name;
  }
  return names;
}

}  // namespace qcowfs::image
