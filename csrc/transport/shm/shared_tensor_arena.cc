#include "transport/shm/shared_tensor_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <iterator>

namespace torus {

namespace {

constexpr size_t kPage = 4096;
// Above this a segment is rounded to huge-page size, so that sizes that differ a little (one
// bucket and the next) share free segments.
constexpr size_t kHugePage = 2 << 20;

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

} // namespace

SharedTensorArena& SharedTensorArena::instance() {
  // Never destroyed: tensors freed during static destruction still come back to it.
  static SharedTensorArena* arena = new SharedTensorArena();
  return *arena;
}

std::optional<SharedTensorArena::Segment> SharedTensorArena::create(size_t bytes) {
  const int fd = ::memfd_create(kName, MFD_CLOEXEC);
  if (fd < 0) {
    return std::nullopt;
  }
  void* base = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (base == MAP_FAILED) {
    ::close(fd);
    return std::nullopt;
  }
  if (bytes >= kHugePage) {
    // 2 MiB pages where the system lets shared memory have them (shmem_enabled "advise" or wider).
    ::madvise(base, bytes, MADV_HUGEPAGE);
  }
  return Segment{fd, reinterpret_cast<uint64_t>(base), bytes};
}

void* SharedTensorArena::allocate(size_t nbytes) {
  if (nbytes < kMinBytes) {
    return nullptr;
  }
  const size_t bytes = roundUp(nbytes, nbytes >= kHugePage ? kHugePage : kPage);
  std::lock_guard<std::mutex> lock(mutex_);
  auto fit = free_.lower_bound(bytes);
  std::optional<Segment> segment;
  if (fit != free_.end() && fit->first <= bytes + bytes / 4) {
    segment = fit->second;
    free_.erase(fit);
  } else {
    segment = create(bytes);
  }
  if (!segment) {
    return nullptr;
  }
  live_.emplace(segment->base, *segment);
  return reinterpret_cast<void*>(segment->base);
}

void SharedTensorArena::release(void* data) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<uint64_t>(data));
  if (it == live_.end()) {
    return;
  }
  free_.emplace(it->second.bytes, it->second);
  live_.erase(it);
}

std::optional<SharedTensorArena::Segment> SharedTensorArena::segmentHolding(uint64_t address, size_t nbytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.upper_bound(address);
  if (it == live_.begin()) {
    return std::nullopt;
  }
  const Segment& segment = std::prev(it)->second;
  if (address + nbytes > segment.base + segment.bytes) {
    return std::nullopt;
  }
  return segment;
}

std::string SharedTensorArena::claimProblem(uint64_t address, uint64_t nbytes, uint64_t segmentBase,
                                            uint64_t segmentBytes) {
  const uint64_t end = address + nbytes;
  const uint64_t segmentEnd = segmentBase + segmentBytes;
  const bool wraps = end < address || segmentEnd < segmentBase;
  if (!wraps && address >= segmentBase && end <= segmentEnd) {
    return {};
  }
  return "posted " + std::to_string(nbytes) + " bytes at " + std::to_string(address) +
         ", outside the shared tensor segment it named (" + std::to_string(segmentBytes) + " bytes at " +
         std::to_string(segmentBase) + ")";
}

std::string SharedTensorArena::fileProblem(const std::string& target, uint64_t fileBytes, uint64_t segmentBytes) {
  if (target.rfind(std::string("/memfd:") + kName, 0) != 0) {
    return "named as a shared tensor segment an fd that is " + target;
  }
  if (fileBytes != segmentBytes) {
    return "named a shared tensor segment of " + std::to_string(segmentBytes) + " bytes whose file holds " +
           std::to_string(fileBytes);
  }
  return {};
}

} // namespace torus
