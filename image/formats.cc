// The format table (image/format.h). A new format adds its row here and its
// folder under image/.
#include <array>

#include "image/format.h"
#include "image/luks/luks.h"
#include "image/parallels/parallels.h"
#include "image/parallels/parallels_check.h"
#include "image/parallels/parallels_create.h"
#include "image/qcow2/qcow2.h"
#include "image/qcow2/qcow2_create.h"
#include "image/qcow2/qcow2_bitmap.h"
#include "image/qcow2/qcow2_snapshot.h"
#include "image/qed/qed.h"
#include "image/qed/qed_check.h"
#include "image/qed/qed_create.h"
#include "image/raw/raw.h"
#include "image/vdi/vdi.h"
#include "image/vdi/vdi_check.h"
#include "image/vdi/vdi_create.h"
#include "image/vhdx/vhdx.h"
#include "image/vhdx/vhdx_check.h"
#include "image/vhdx/vhdx_create.h"
#include "image/vmdk/vmdk.h"
#include "image/vmdk/vmdk_check.h"
#include "image/vmdk/vmdk_create.h"
#include "image/vpc/vpc.h"
#include "image/vpc/vpc_create.h"

namespace qcowfs::image {
namespace {

const std::array kFormats = {
    FormatInfo{.name = "raw", .display = "raw", .open = open_raw, .prepare_create = prepare_raw_create},
    FormatInfo{.name = "qcow2",
               .display = "qcow2",
               .open = open_qcow2,
               .prepare_create = qcow2::prepare_qcow2_create,
               .check = check_qcow2,
               .describe = describe_qcow2,
               .snapshot = &kQcow2SnapshotOps,
               .bitmap = &kQcow2BitmapOps},
    FormatInfo{.name = "qcow", .display = "qcow (version 1)", .open = nullptr},
    FormatInfo{.name = "vmdk", .display = "VMDK", .open = open_vmdk, .prepare_create = prepare_vmdk_create, .check = check_vmdk},
    FormatInfo{.name = "vhdx", .display = "VHDX", .open = open_vhdx, .prepare_create = prepare_vhdx_create, .check = check_vhdx},
    FormatInfo{.name = "vpc", .display = "VHD (vpc)", .open = open_vpc, .prepare_create = prepare_vpc_create},
    FormatInfo{.name = "vdi", .display = "VDI", .open = open_vdi, .prepare_create = prepare_vdi_create, .check = check_vdi},
    FormatInfo{.name = "qed",
               .display = "QED",
               .open = open_qed,
               .prepare_create = prepare_qed_create,
               .check = check_qed},
    FormatInfo{.name = "parallels",
               .display = "Parallels",
               .open = open_parallels,
               .prepare_create = prepare_parallels_create,
               .check = check_parallels},
    FormatInfo{.name = "luks",
               .display = "LUKS",
               .open = open_luks,
               .prepare_create = prepare_luks_create,
               .describe = describe_luks},
    FormatInfo{.name = "bochs", .display = "Bochs", .open = nullptr},
    FormatInfo{.name = "cloop", .display = "cloop", .open = nullptr},
    FormatInfo{.name = "dmg", .display = "DMG", .open = nullptr},
};

}  // namespace

std::span<const FormatInfo> all_formats() { return kFormats; }

const FormatInfo* find_format(std::string_view name) {
  if (name == "vhd") name = "vpc";
  for (const FormatInfo& f : kFormats)
    if (f.name == name) return &f;
  return nullptr;
}

std::string_view default_create_format() { return "qcow2"; }

std::string creatable_format_names() {
  std::string names;
  for (const FormatInfo& f : kFormats) {
    if (f.prepare_create == nullptr) continue;
    if (!names.empty()) names += ", ";
    names += f.name;
  }
  return names;
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
