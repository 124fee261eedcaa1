#include "transport/shm/huge_page_backing.h"

#include <algorithm>

#include <sys/mman.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 // Linux 6.1; older C libraries do not name it
#endif

namespace torus {

namespace {

constexpr uint64_t kHugePage = uint64_t{2} << 20;

} // namespace

void HugePageBacking::prepare(uint64_t address, size_t nbytes) {
  if (nbytes < kMinBytes) {
    return;
  }
  // Only whole huge pages inside the buffer: its neighbours' memory is not ours to move.
  const uint64_t begin = (address + kHugePage - 1) & ~(kHugePage - 1);
  const uint64_t end = (address + nbytes) & ~(kHugePage - 1);
  if (end <= begin) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto known = std::find_if(buffers_.begin(), buffers_.end(),
                              [&](const Buffer& b) { return b.address == address && b.nbytes == nbytes; });
    if (known == buffers_.end()) {
      buffers_.push_back({address, nbytes, false});
      if (buffers_.size() > kRemembered) {
        buffers_.pop_front();
      }
      return;
    }
    if (known->asked) {
      return;
    }
    known->asked = true;
  }
  // Outside the lock: it copies the buffer. A failure leaves it on small pages.
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_COLLAPSE);
}

} // namespace torus
