// ShmTransport::Members: the SharedMemory of some of the ranks a ShmTransport connects (a Comm's:
// the whole group, or a torus row on this host), numbered as the Comm numbers them. It turns
// those numbers into transport ranks and keeps the pair epochs of the collective in progress.
#include <algorithm>
#include <memory>
#include <vector>

#include "transport/shm/shared_tensor_arena.h"
#include "transport/shm/shm_transport.h"
#include "transport/traffic_counters.h"

namespace torus {

class ShmTransport::Members : public SharedMemory {
 public:
  // members: transport ranks, this rank among them, each connected by `shm`. traffic may be null.
  Members(ShmTransport& shm, std::vector<int> members, std::shared_ptr<TrafficCounters> traffic)
      : shm_(shm),
        traffic_(std::move(traffic)),
        members_(std::move(members)),
        self_(static_cast<size_t>(std::find(members_.begin(), members_.end(), shm.rank()) - members_.begin())),
        pairEpochs_(members_.size(), 0) {
    for (size_t i = 0; i < members_.size(); ++i) {
      if (i != self_) {
        peers_.push_back(members_[i]);
      }
    }
  }

  bool singleCopy() const override {
    return shm_.singleCopy();
  }

  uint64_t beginCollective() override {
    for (size_t i = 0; i < members_.size(); ++i) {
      if (i != self_) {
        pairEpochs_[i] = shm_.nextEpochWith(members_[i]);
      }
    }
    return shm_.nextOwnEpoch();
  }

  char* claimSlot(uint64_t epoch, Deadline deadline) override {
    return shm_.claimSlot(epoch, static_cast<int>(peers_.size()), deadline);
  }

  const char* slot(int rank, uint64_t epoch) const override {
    return shm_.slot(members_[rank], epoch);
  }

  void releaseSlot(int rank, uint64_t epoch) override {
    shm_.releaseSlot(members_[rank], epoch);
  }

  void post(const Posting& posting) override {
    Posting withSegment{posting.epoch, posting.address, posting.nbytes, posting.tag, posting.call};
    if (auto segment = SharedTensorArena::instance().segmentHolding(posting.address, posting.nbytes)) {
      withSegment.segmentFd = segment->fd;
      withSegment.segmentBase = segment->base;
      withSegment.segmentBytes = segment->bytes;
      withSegment.segmentId = segment->id;
    } else {
      shm_.prepareForPeers(posting.address, posting.nbytes);
    }
    // Read after segmentHolding: the segment given back before a later one took its fd is counted.
    withSegment.releasedSegments = SharedTensorArena::instance().releasedSegments();
    for (size_t i = 0; i < members_.size(); ++i) {
      if (i != self_) {
        shm_.post(members_[i], pairEpochs_[i], withSegment);
      }
    }
  }

  Posting waitPosted(int peer, const Posting& mine, Deadline deadline) override {
    return shm_.waitPosted(members_[peer], pairEpochs_[peer], mine, deadline);
  }

  void readPeer(int peer, uint64_t address, void* dst, size_t nbytes) override {
    count(peer, nbytes);
    shm_.readPeer(members_[peer], address, dst, nbytes);
  }

  void writePeer(int peer, uint64_t address, const void* src, size_t nbytes) override {
    count(peer, nbytes);
    shm_.writePeer(members_[peer], address, src, nbytes);
  }

  void useMapped(int peer, size_t nbytes, const std::function<void()>& use) override {
    count(peer, nbytes);
    shm_.useMapped(members_[peer], use);
  }

  void signalDelivered(int peer) override {
    shm_.signalDelivered(members_[peer]);
  }

  void waitDeliveries(Deadline deadline) override {
    shm_.waitDeliveries(peers_, deadline);
  }

 private:
  void count(int peer, size_t nbytes) {
    if (traffic_) {
      traffic_->count(members_[peer], nbytes);
    }
  }

  ShmTransport& shm_;
  const std::shared_ptr<TrafficCounters> traffic_;
  const std::vector<int> members_;
  const size_t self_;
  std::vector<int> peers_; // members_ but this rank
  std::vector<uint64_t> pairEpochs_; // of the collective begun last, by member
};

std::shared_ptr<SharedMemory> ShmTransport::sharedMemory(const std::vector<int>& members,
                                                        std::shared_ptr<TrafficCounters> traffic) {
  const bool reachesAll = std::all_of(members.begin(), members.end(), [this](int rank) { return connects(rank); });
  if (!reachesAll || std::find(members.begin(), members.end(), rank()) == members.end()) {
    return nullptr;
  }
  return std::make_shared<Members>(*this, members, std::move(traffic));
}

} // namespace torus
