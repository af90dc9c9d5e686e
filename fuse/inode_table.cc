#include "fuse/inode_table.h"

#include <algorithm>
#include <array>

#include "fuse/access.h"
#include "image/views/bitmap_view.h"
#include "io/align.h"
#include "io/log.h"

namespace qcowfs::fuse {

InodeTable InodeTable::directory_root() {
  InodeTable t;
  t.add(0, "", NodeKind::directory, nullptr);
  return t;
}

InodeTable InodeTable::file_root(std::unique_ptr<ImageFile> root_file) {
  InodeTable t;
  t.add(0, "", NodeKind::image, std::move(root_file));
  return t;
}

Ino InodeTable::add(Ino parent, std::string name, NodeKind kind, std::unique_ptr<ImageFile> file) {
  Node n;
  n.ino = kRootIno + nodes_.size();
  n.parent = parent == 0 ? n.ino : parent;
  n.kind = kind;
  n.name = std::move(name);
  n.file = std::move(file);
  nodes_.push_back(std::move(n));
  Ino ino = nodes_.back().ino;
  if (parent != 0) nodes_[parent - kRootIno].children.push_back(ino);
  return ino;
}

Ino InodeTable::add_directory(Ino parent, std::string name) {
  return add(parent, std::move(name), NodeKind::directory, nullptr);
}

Ino InodeTable::add_image(Ino parent, std::string name, std::unique_ptr<ImageFile> file) {
  return add(parent, std::move(name), NodeKind::image, std::move(file));
}

std::vector<Ino> InodeTable::children(const Node& dir) const {
  if (DynamicDirectory* d = dynamic_for(dir.ino)) return d->children(dir.ino);
  return dir.children;
}

const Node* InodeTable::get(Ino ino) const {
  if (ino >= kRootIno && ino - kRootIno < nodes_.size()) return &nodes_[ino - kRootIno];
  for (const auto& d : dynamic_)
    if (const Node* n = d->get(ino)) return n;
  return nullptr;
}

const Node* InodeTable::lookup(Ino parent, std::string_view name) const {
  if (DynamicDirectory* d = dynamic_for(parent)) return d->lookup(parent, name);
  const Node* dir = get(parent);
  if (!dir || dir->kind != NodeKind::directory) return nullptr;
  for (Ino child : dir->children) {
    const Node& n = nodes_[child - kRootIno];
    if (n.name == name) return &n;
  }
  return nullptr;
}

std::vector<ImageFile*> InodeTable::image_files() const {
  std::vector<ImageFile*> out;
  for (const Node& n : nodes_)
    if (n.file) out.push_back(n.file.get());
  for (const auto& d : dynamic_)
    for (ImageFile* f : d->image_files()) out.push_back(f);
  return out;
}

struct stat InodeTable::attributes(const Node& node, const AttrContext& ctx) const {
  struct stat st = {};
  st.st_ino = node.ino;
  const ViewAttrs view = node.access ? node.access->get() : ctx.view;
  st.st_uid = view.uid;
  st.st_gid = view.gid;
  st.st_atim = st.st_mtim = st.st_ctim = ctx.mount_time;
  st.st_blksize = 4096;
  if (node.kind == NodeKind::directory) {
    st.st_mode = S_IFDIR | directory_permissions(view.mode, ctx.dir_mask);
    st.st_nlink = 2;
    for (Ino child : node.children)
      if (nodes_[child - kRootIno].kind == NodeKind::directory) ++st.st_nlink;
    return st;
  }
  st.st_mode = S_IFREG | file_permissions(view.mode, node.file->writable());
  st.st_nlink = 1;
  st.st_size = static_cast<off_t>(node.file->size());
  st.st_blocks = static_cast<blkcnt_t>(div_round_up(node.file->allocated_bytes(), 512));
  return st;
}

std::string raw_view_name(std::string_view image_path) {
  std::string_view name = image_path;
  while (name.size() > 1 && name.ends_with('/')) name.remove_suffix(1);
  if (size_t slash = name.rfind('/'); slash != std::string_view::npos) name.remove_prefix(slash + 1);
  // The image formats' usual file name suffixes (Parallels: .hds). run.sh's
  // view_name() strips the same list (test_mount_cli.py compares them).
  static constexpr std::array<std::string_view, 10> kSuffixes = {".qcow2", ".img", ".raw", ".vmdk", ".vhdx",
                                                                 ".vhd",   ".vdi", ".qed", ".hds",  ".luks"};
  for (std::string_view suffix : kSuffixes) {
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      name.remove_suffix(suffix.size());
      break;
    }
  }
  return std::string(name) + ".raw";
}

namespace {

// "<name>.raw" when that is a usable file name not taken already, else fallback.
std::string view_file_name(std::string_view name, std::string fallback, const std::vector<std::string>& taken) {
  std::string candidate = std::string(name) + ".raw";
  bool usable = !name.empty() && name.find('/') == std::string_view::npos &&
                name.find('\0') == std::string_view::npos && candidate.size() <= 255;
  if (usable && std::find(taken.begin(), taken.end(), candidate) == taken.end()) return candidate;
  return fallback;
}

}  // namespace

std::string snapshot_file_name(std::string_view name, std::string_view id,
                               const std::vector<std::string>& taken) {
  return view_file_name(name, fmt::format("snapshot-{}.raw", id), taken);
}

void add_bitmap_directory(InodeTable& table, image::BlockDriver& driver) {
  std::vector<image::BitmapInfo> bitmaps = driver.dirty_bitmaps();
  Ino dir = 0;
  std::vector<std::string> taken;
  for (size_t i = 0; i < bitmaps.size(); ++i) {
    const image::BitmapInfo& b = bitmaps[i];
    if (b.inconsistent) {
      log::warn("bitmap '{}' is inconsistent (it was in use when the image was last closed) and is not shown in "
                "bitmaps/; remove it with qcowfs bitmap --remove", b.name);
      continue;
    }
    if (dir == 0) dir = table.add_directory(kRootIno, "bitmaps");
    std::string name = view_file_name(b.name, fmt::format("bitmap-{}.raw", i + 1), taken);
    taken.push_back(name);
    table.add_image(dir, std::move(name), std::make_unique<ImageFile>(image::make_bitmap_view(&driver, b.name)));
  }
}

}  // namespace qcowfs::fuse
