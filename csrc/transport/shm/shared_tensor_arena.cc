#include "transport/shm/shared_tensor_arena.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
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
  static SharedTensorArena* arena = [] {
    auto* created = new SharedTensorArena();
    ::pthread_atfork([] { instance().beforeFork(); }, [] { instance().afterForkInParent(); },
                     [] { instance().afterForkInChild(); });
    return created;
  }();
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
  return Segment{fd, reinterpret_cast<uint64_t>(base), bytes, nextId_++};
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
    freeBytes_ -= segment->bytes;
    free_.erase(fit);
  } else {
    segment = create(bytes);
    if (!segment && !free_.empty()) {
      // Out of memory or descriptors: what is kept for reuse is worth less than this tensor.
      trimTo(0);
      segment = create(bytes);
    }
  }
  if (!segment) {
    return nullptr;
  }
  live_.emplace(segment->base, *segment);
  liveBytes_ += segment->bytes;
  peakLiveBytes_ = std::max(peakLiveBytes_, liveBytes_);
  return reinterpret_cast<void*>(segment->base);
}

void SharedTensorArena::release(void* data) {
  const auto base = reinterpret_cast<uint64_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(base);
  if (it == live_.end()) {
    auto inherited = inherited_.find(base);
    if (inherited != inherited_.end()) {
      ::munmap(data, inherited->second);
      inherited_.erase(inherited);
    }
    return;
  }
  Segment segment = it->second;
  live_.erase(it);
  liveBytes_ -= segment.bytes;
  segment.freedAt = ++frees_;
  free_.emplace(segment.bytes, segment);
  freeBytes_ += segment.bytes;
  trimTo(limitLocked());
}

uint64_t SharedTensorArena::limitLocked() const {
  if (groups_.empty()) {
    return 0;
  }
  const int64_t limit = groups_.back().second;
  return limit == kAutoLimit ? peakLiveBytes_ : static_cast<uint64_t>(limit);
}

void SharedTensorArena::trimTo(uint64_t keep) {
  while (freeBytes_ > keep) {
    auto oldest = std::min_element(free_.begin(), free_.end(), [](const auto& a, const auto& b) {
      return a.second.freedAt < b.second.freedAt;
    });
    const Segment& segment = oldest->second;
    ::munmap(reinterpret_cast<void*>(segment.base), segment.bytes);
    ::close(segment.fd);
    freeBytes_ -= segment.bytes;
    free_.erase(oldest);
    released_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void SharedTensorArena::attachGroup(const void* group, int64_t cacheLimit) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.emplace_back(group, cacheLimit);
  trimTo(limitLocked());
}

void SharedTensorArena::detachGroup(const void* group) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(groups_.begin(), groups_.end(), [group](const auto& entry) { return entry.first == group; });
  if (it == groups_.end()) {
    return;
  }
  groups_.erase(it);
  if (groups_.empty()) {
    peakLiveBytes_ = liveBytes_;
  }
  trimTo(limitLocked());
}

uint64_t SharedTensorArena::emptyCache() {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t freed = freeBytes_;
  trimTo(0);
  // "Recent" restarts here: the limit follows the working set from now on.
  peakLiveBytes_ = liveBytes_;
  return freed;
}

SharedTensorArena::Stats SharedTensorArena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return Stats{liveBytes_,     live_.size(),     freeBytes_,
               free_.size(),   limitLocked(),    peakLiveBytes_,
               released_.load(std::memory_order_acquire)};
}

void SharedTensorArena::beforeFork() {
  mutex_.lock();
}

void SharedTensorArena::afterForkInParent() {
  mutex_.unlock();
}

void SharedTensorArena::afterForkInChild() {
  // The child is single-threaded here, and glibc's malloc is usable again (it runs these handlers
  // after resetting its own locks).
  for (const auto& [base, segment] : live_) {
    // The same pages, but a write in the child copies its page instead of reaching the parent.
    void* at = ::mmap(reinterpret_cast<void*>(base), segment.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED,
                      segment.fd, 0);
    if (at != MAP_FAILED) {
      ::close(segment.fd);
      inherited_.emplace(base, segment.bytes);
    }
    // Else the mapping is still the shared one and the fd stays open: the tensor reads as before,
    // and the parent's segment is never unmapped under it.
  }
  for (const auto& [bytes, segment] : free_) {
    ::munmap(reinterpret_cast<void*>(segment.base), segment.bytes);
    ::close(segment.fd);
  }
  live_.clear();
  free_.clear();
  liveBytes_ = freeBytes_ = peakLiveBytes_ = 0;
  groups_.clear();
  mutex_.unlock();
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
