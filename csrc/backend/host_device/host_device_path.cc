#include "backend/host_device/host_device_path.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "reduce/reduce.h"

namespace torus {

namespace {

uintptr_t address(const void* p) {
  return reinterpret_cast<uintptr_t>(p);
}

bool rangesOverlap(const void* a, size_t aBytes, const void* b, size_t bBytes) {
  return address(a) < address(b) + bBytes && address(b) < address(a) + aBytes;
}

std::string describe(const void* p, size_t nbytes) {
  std::ostringstream text;
  text << "[" << p << ", +" << nbytes << ")";
  return text.str();
}

} // namespace

HostDeviceFault HostDeviceFault::parse(const std::string& setting) {
  HostDeviceFault fault;
  if (setting == "on") {
    return fault;
  }
  const auto colon = setting.find(':');
  const std::string kind = setting.substr(0, colon);
  const std::string step = colon == std::string::npos ? "" : setting.substr(colon + 1);
  if (kind == "stall" && !step.empty()) {
    return HostDeviceFault{Kind::kStall, step};
  }
  if (kind == "fail" && step == "enter") {
    return HostDeviceFault{Kind::kFail, step};
  }
  throw std::invalid_argument("TORUS_HOST_DEVICE='" + setting + "': expected off, on, stall:<step> or fail:enter");
}

bool HostDeviceFault::stalls(const char* phaseStep) const {
  return kind == Kind::kStall && std::strstr(phaseStep, step.c_str()) != nullptr;
}

bool Region::holds(const void* p, size_t nbytes) const {
  return address(p) >= address(begin) && nbytes <= bytes && address(p) - address(begin) <= bytes - nbytes;
}

void stallUntil(Deadline bound, const std::string& what, std::chrono::milliseconds stallBound) {
  std::this_thread::sleep_until(bound);
  throw CommError(CommError::Kind::kTimeout, kStalledIn + what + ": the host device's work did not complete within " +
                                                 "the stall bound of " + std::to_string(stallBound.count()) + " ms");
}

HostDevicePath::HostDevicePath(bool deferred, std::chrono::milliseconds stallBound, HostDeviceFault fault)
    : deferred_(deferred), stallBound_(stallBound), fault_(std::move(fault)) {}

HostDevicePath::~HostDevicePath() {
  for (Buffer& buffer : staging_) {
    std::free(buffer.data);
  }
}

void HostDevicePath::copy(void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) {
    return;
  }
  const RegionKind to = classify(dst, nbytes, "copy destination", true);
  const RegionKind from = classify(src, nbytes, "copy source", false);
  if (rangesOverlap(dst, nbytes, src, nbytes)) {
    throw std::logic_error("HostDevicePath: copy from " + describe(src, nbytes) + " to the overlapping " +
                           describe(dst, nbytes));
  }
  ++stats_.copies;
  account(to, nbytes, true);
  account(from, nbytes, false);
  run([dst, src, nbytes] { std::memcpy(dst, src, nbytes); });
}

void HostDevicePath::reduce(const DeviceReduction& op, void* dst, const void* const* srcs, int numSources,
                            size_t count) {
  if (numSources < 1) {
    throw std::logic_error("HostDevicePath: a reduction of " + std::to_string(numSources) + " sources");
  }
  const Reducer reducer = makeReducer(op.dtype, op.kind);
  if (reducer.fn == nullptr) {
    throw std::invalid_argument(std::string("HostDevicePath: no reduction ") + reduceKindName(op.kind) + " of " +
                                dataTypeName(op.dtype));
  }
  if (count == 0) {
    return;
  }
  const size_t nbytes = count * reducer.elementSize;
  const RegionKind to = classify(dst, nbytes, "reduce destination", true);
  std::vector<const char*> sources;
  bool destinationLater = false;
  for (int i = 0; i < numSources; ++i) {
    account(classify(srcs[i], nbytes, "reduce source", false), nbytes, false);
    if (srcs[i] != dst && rangesOverlap(srcs[i], nbytes, dst, nbytes)) {
      throw std::logic_error("HostDevicePath: reduce source " + std::to_string(i) + " " + describe(srcs[i], nbytes) +
                             " partially overlaps its destination " + describe(dst, nbytes));
    }
    destinationLater = destinationLater || (i > 0 && srcs[i] == dst);
    sources.push_back(static_cast<const char*>(srcs[i]));
  }
  ++stats_.reduces;
  account(to, nbytes, true);
  char* target = static_cast<char*>(dst);
  run([this, reducer, target, sources = std::move(sources), count, nbytes, destinationLater] {
    // dst = srcs[0] (op) srcs[1] ...: folded in place when dst is srcs[0] or none of them; through
    // a temporary when dst is a later source, whose original value the fold still needs.
    char* out = destinationLater ? static_cast<char*>(temporary_.get(nbytes)) : target;
    if (out != sources[0]) {
      std::memcpy(out, sources[0], nbytes);
    }
    for (size_t i = 1; i < sources.size(); ++i) {
      reducer(out, sources[i], count);
    }
    if (out != target) {
      std::memcpy(target, out, nbytes);
    }
  });
}

void HostDevicePath::synchronize(Deadline deadline, const DevicePhase& phase) {
  ++stats_.synchronizes;
  const Deadline bound = phaseDeadline(*this, deadline);
  if (fault_.stalls(phase.step)) {
    stallUntil(bound, phase.describe(), stallBound_);
  }
  flush();
  if (Clock::now() > deadline) {
    throw CommError(CommError::Kind::kTimeout, "timed out in " + phase.describe() + " on the host device path");
  }
}

char* HostDevicePath::staging(StagingUse use, size_t nbytes, Deadline deadline) {
  Buffer& buffer = staging_.at(static_cast<size_t>(use));
  if (nbytes <= buffer.bytes) {
    return buffer.data;
  }
  // As the CUDA path waits for its stream before freeing pinned memory.
  synchronize(deadline, {"release of the staging buffer that grows"});
  std::free(buffer.data);
  buffer = Buffer{};
  const size_t rounded = (nbytes + 63) / 64 * 64;
  char* data = static_cast<char*>(std::aligned_alloc(64, rounded));
  if (data == nullptr) {
    throw std::bad_alloc();
  }
  std::memset(data, 0xff, rounded);
  buffer = Buffer{data, nbytes};
  ++stats_.stagingAllocations;
  stagingRegions_.clear();
  for (size_t i = 0; i < staging_.size(); ++i) {
    if (staging_[i].data != nullptr) {
      stagingRegions_.push_back(Region{staging_[i].data, staging_[i].bytes, RegionKind::kStaging,
                                       i == static_cast<size_t>(StagingUse::kMirror) ? "staging (mirror)"
                                                                                     : "staging (slots)"});
    }
  }
  return buffer.data;
}

void HostDevicePath::setRegions(std::vector<Region> regions) {
  checked_ = true;
  regions_ = std::move(regions);
}

void HostDevicePath::flush() {
  std::vector<std::function<void()>> queued;
  queued.swap(queue_);
  for (const auto& operation : queued) {
    operation();
  }
}

void HostDevicePath::discard() {
  queue_.clear();
}

void HostDevicePath::run(std::function<void()> operation) {
  if (deferred_) {
    queue_.push_back(std::move(operation));
  } else {
    operation();
  }
}

RegionKind HostDevicePath::classify(const void* p, size_t nbytes, const char* what, bool write) const {
  if (!checked_) {
    return RegionKind::kDevice;
  }
  const Region* found = nullptr;
  for (const std::vector<Region>* regions : {&regions_, &stagingRegions_}) {
    for (const Region& region : *regions) {
      if (region.holds(p, nbytes)) {
        found = &region;
      }
    }
  }
  if (found == nullptr) {
    std::string near;
    for (const std::vector<Region>* regions : {&regions_, &stagingRegions_}) {
      for (const Region& region : *regions) {
        if (rangesOverlap(p, nbytes, region.begin, region.bytes)) {
          near += (near.empty() ? "" : ", ") + region.name + " " + describe(region.begin, region.bytes);
        }
      }
    }
    throw std::logic_error(std::string("HostDevicePath: ") + what + " " + describe(p, nbytes) +
                           (near.empty() ? " is outside every buffer the collective may touch"
                                         : " crosses the end of " + near));
  }
  if (write && found->kind == RegionKind::kPeerArena) {
    throw std::logic_error(std::string("HostDevicePath: ") + what + " " + describe(p, nbytes) + " is in " +
                           found->name + ": a rank writes only its own arena");
  }
  return found->kind;
}

void HostDevicePath::account(RegionKind kind, size_t nbytes, bool write) {
  if (kind == RegionKind::kOwnArena && write) {
    stats_.arenaBytesWritten += nbytes;
  } else if ((kind == RegionKind::kOwnArena || kind == RegionKind::kPeerArena) && !write) {
    stats_.arenaBytesRead += nbytes;
  } else if (kind == RegionKind::kStaging) {
    stats_.stagingBytes += nbytes;
  }
}

} // namespace torus
