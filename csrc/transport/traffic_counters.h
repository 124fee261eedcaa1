// TrafficCounters: what a group moved to ranks of its own host and of other hosts.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace torus {

// Bytes and messages a group has sent to peers on its own host and on other hosts: what shows
// whether an algorithm keeps its traffic off the links between hosts (a host-rowed torus against
// a ring). Counted as messages are posted, and as single copies move bytes between this rank's
// memory and a peer's (either way: what a single-copy reduce-scatter reads, a ring would have
// sent); shared by a Comm, its subsets and their shared memory.
class TrafficCounters {
 public:
  // sameHost[r]: transport rank r lives on this process's host.
  explicit TrafficCounters(std::vector<bool> sameHost) : sameHost_(std::move(sameHost)) {}
  void count(int transportRank, size_t nbytes) {
    Counter& counter = sameHost_.at(static_cast<size_t>(transportRank)) ? sameHostSent_ : otherHostSent_;
    counter.bytes.fetch_add(nbytes, std::memory_order_relaxed);
    counter.messages.fetch_add(1, std::memory_order_relaxed);
  }
  struct Snapshot {
    uint64_t sameHostBytes, sameHostMessages, otherHostBytes, otherHostMessages;
  };
  Snapshot snapshot() const {
    return {sameHostSent_.bytes.load(), sameHostSent_.messages.load(), otherHostSent_.bytes.load(),
            otherHostSent_.messages.load()};
  }
  void reset() {
    for (Counter* counter : {&sameHostSent_, &otherHostSent_}) {
      counter->bytes.store(0);
      counter->messages.store(0);
    }
  }

 private:
  struct Counter {
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> messages{0};
  };
  const std::vector<bool> sameHost_;
  Counter sameHostSent_;
  Counter otherHostSent_;
};

} // namespace torus
