// Placeholder until the qcow2 driver lands (replaced in this session's work).
#include "image/qcow2.h"

namespace qcowfs::image {

Task<Result<std::unique_ptr<BlockDriver>>> open_qcow2(std::unique_ptr<io::HostFile>, std::string path,
                                                      ImageOptions) {
  co_return Status::errorf(ENOTSUP, "{}: qcow2 driver not built yet", path);
}

}  // namespace qcowfs::image
