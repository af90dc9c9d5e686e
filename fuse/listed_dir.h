// ListedDirectory: the part common to the dynamic directories that list views
// read from a source (DIR/snapshots/, fuse/snapshots_dir.h; DIR/partitions/,
// fuse/partitions_dir.h). Every entry ever made is kept (all_, by inode: nodes
// are never freed before the directory, so a request holding one stays safe
// across refreshes); the listing (current_) is some of them in the source's
// order. get/lookup/children/image_files answer from these; a subclass's
// refresh re-lists, reusing an entry whose key is unchanged (find()) so it
// keeps its inode, or making one (add()).
// Entry is the subclass's entry type, with a `Node node` member.
// Thread-safety: every method may be called concurrently from any thread; mu_
// guards all_, current_ and the inode counter (the subclass locks it around
// find(), add() and its changes to current_).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "fuse/inode_table.h"

namespace qcowfs::fuse {

template <typename Entry>
class ListedDirectory : public DynamicDirectory {
 public:
  bool has_directory(Ino dir) const override { return dir == dir_; }

  const Node* get(Ino ino) const override {
    std::lock_guard lk(mu_);
    auto it = all_.find(ino);
    return it == all_.end() ? nullptr : &it->second->node;
  }

  const Node* lookup(Ino, std::string_view name) const override {
    std::lock_guard lk(mu_);
    for (const Entry* e : current_)
      if (e->node.name == name) return &e->node;
    return nullptr;
  }

  std::vector<Ino> children(Ino) const override {
    std::lock_guard lk(mu_);
    std::vector<Ino> out;
    for (const Entry* e : current_) out.push_back(e->node.ino);
    return out;
  }

  std::vector<ImageFile*> image_files() const override {
    std::lock_guard lk(mu_);
    std::vector<ImageFile*> out;
    for (const auto& [ino, e] : all_) out.push_back(e->node.file.get());
    return out;
  }

 protected:
  // Entries get inodes from first_ino up (ranges of directories must not overlap).
  ListedDirectory(Ino dir, Ino first_ino) : dir_(dir), next_ino_(first_ino) {}

  // mu_ held: the kept entry for which same(entry) is true, else nullptr.
  template <typename Same>
  Entry* find(Same same) {
    for (auto& [ino, e] : all_)
      if (same(*e)) return e.get();
    return nullptr;
  }

  // mu_ held: keeps `e` as a new image node of this directory, `name`, serving `file`.
  Entry* add(std::unique_ptr<Entry> e, std::string name, std::unique_ptr<ImageFile> file) {
    e->node.ino = next_ino_++;
    e->node.parent = dir_;
    e->node.kind = NodeKind::image;
    e->node.name = std::move(name);
    e->node.file = std::move(file);
    Entry* raw = e.get();
    all_.emplace(raw->node.ino, std::move(e));
    return raw;
  }

  mutable std::mutex mu_;
  std::map<Ino, std::unique_ptr<Entry>> all_;  // every entry ever made, by inode
  std::vector<Entry*> current_;                // the listing, in the source's order

 private:
  const Ino dir_;
  Ino next_ino_;
};

}  // namespace qcowfs::fuse
