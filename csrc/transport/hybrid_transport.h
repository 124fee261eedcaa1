// HybridTransport: shared memory to the ranks of this host, a network transport (TCP or OFI) to
// the others — for a group whose ranks span several hosts with more than one rank on some of
// them. A host-rowed torus then runs its row phases in shared memory and only its column phase
// on the network.
//
// Both transports number ranks as the group does. A collective's message goes by shared memory
// when its peer shares this host; point-to-point messages always go by the network, which
// connects every pair, so a receive from any rank has one place to match.
//
// Waiting: requests are routed back to the transport that made them. The wait alternates between
// the two in slices of kSlice: it waits on one side's requests (progress, then a sleep on its own
// doorbell or sockets) and then the other's, or, where it has none to wait for, moves that
// side's other pending messages without sleeping. So a message on one side waits at most a slice
// while the thread sleeps on the other, and neither side's messages stall while the thread waits
// on the other's.
#pragma once

#include <memory>
#include <vector>

#include "transport/shm/shm_transport.h"

namespace torus {

class HybridTransport : public Transport {
 public:
  static constexpr auto kSlice = std::chrono::microseconds(500);

  // sameHost[r]: rank r shares this process's host.
  HybridTransport(std::unique_ptr<PolledTransport> network, std::unique_ptr<ShmTransport> shm,
                  std::vector<bool> sameHost);

  int rank() const override {
    return network_->rank();
  }
  int size() const override {
    return network_->size();
  }
  RequestPtr isend(int peer, uint64_t tag, const CallSignature& call, const void* buf, size_t nbytes) override;
  RequestPtr irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) override;
  void wait(const std::vector<RequestPtr>& requests, Deadline deadline) override;
  bool test(const RequestPtr& request) override;
  void abort(const std::string& why) override;
  std::optional<StrayMessage> strayMessage(uint64_t upToTag) override;
  // The shm side's: members on this host only.
  std::shared_ptr<SharedMemory> sharedMemory(const std::vector<int>& members,
                                             std::shared_ptr<TrafficCounters> traffic) override;

 private:
  PolledTransport& route(int peer, uint64_t tag) const;
  PolledTransport& ownerOf(const RequestPtr& request) const;

  std::unique_ptr<PolledTransport> network_;
  std::unique_ptr<ShmTransport> shm_;
  std::vector<bool> sameHost_;
};

} // namespace torus
