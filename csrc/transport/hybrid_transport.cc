#include "transport/hybrid_transport.h"

#include <algorithm>

namespace torus {

HybridTransport::HybridTransport(std::unique_ptr<PolledTransport> network, std::unique_ptr<ShmTransport> shm,
                                 std::vector<bool> sameHost)
    : network_(std::move(network)), shm_(std::move(shm)), sameHost_(std::move(sameHost)) {}

PolledTransport& HybridTransport::route(int peer, uint64_t tag) const {
  const bool local = peer >= 0 && peer < size() && sameHost_[static_cast<size_t>(peer)] && peer != rank();
  if (local && tag < kP2PTagBase) {
    return *shm_;
  }
  return *network_;
}

PolledTransport& HybridTransport::ownerOf(const RequestPtr& request) const {
  return static_cast<const PendingOp&>(*request).owner == shm_.get() ? static_cast<PolledTransport&>(*shm_)
                                                                       : *network_;
}

RequestPtr HybridTransport::isend(int peer, uint64_t tag, const CallSignature& call, const void* buf,
                                  size_t nbytes) {
  return route(peer, tag).isend(peer, tag, call, buf, nbytes);
}

RequestPtr HybridTransport::irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) {
  return route(peer, tag).irecv(peer, tag, call, buf, nbytes);
}

void HybridTransport::wait(const std::vector<RequestPtr>& requests, Deadline deadline) {
  std::vector<RequestPtr> local, remote;
  for (const auto& request : requests) {
    (&ownerOf(request) == shm_.get() ? local : remote).push_back(request);
  }
  // Each side's other pending messages move too (a send still owed to another host, a ring that
  // a peer of this host fills): the algorithm's progress elsewhere may hang on them.
  bool localDone = local.empty();
  bool remoteDone = remote.empty();
  for (;;) {
    const Deadline slice = std::min(deadline, Clock::now() + kSlice);
    if (localDone) {
      shm_->poke();
    } else {
      localDone = shm_->waitFor(local, slice);
    }
    if (remoteDone) {
      network_->poke();
    } else {
      remoteDone = network_->waitFor(remote, slice);
    }
    if (localDone && remoteDone) {
      return;
    }
    if (Clock::now() >= deadline) {
      throw CommError(CommError::Kind::kTimeout,
                      "timed out waiting for " + describePending(localDone ? remote : remoteDone ? local : requests));
    }
  }
}

bool HybridTransport::test(const RequestPtr& request) {
  return ownerOf(request).test(request);
}

void HybridTransport::abort(const std::string& why) {
  shm_->abort(why);
  network_->abort(why);
}

std::optional<Transport::StrayMessage> HybridTransport::strayMessage(uint64_t upToTag) {
  auto stray = shm_->strayMessage(upToTag);
  return stray ? stray : network_->strayMessage(upToTag);
}

std::shared_ptr<SharedMemory> HybridTransport::sharedMemory(const std::vector<int>& members,
                                                           std::shared_ptr<TrafficCounters> traffic) {
  return shm_->sharedMemory(members, std::move(traffic));
}

} // namespace torus
