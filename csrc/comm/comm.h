// Comm: the ranks an algorithm talks to, numbered 0..size()-1 — the whole group, a torus row or
// a torus column. A view over a Transport: it maps its own ranks to transport ranks and carries
// the tag and deadline of the collective in progress.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "comm/device_path.h"
#include "transport/shared_memory.h"
#include "transport/traffic_counters.h"
#include "transport/transport.h"

namespace torus {

class Comm {
 public:
  // members[i] is the transport rank of this Comm's rank i; self is this process's index.
  // `traffic` (may be null) counts what isend posts and what shared memory copies.
  Comm(std::shared_ptr<Transport> transport, std::vector<int> members, int self,
       std::shared_ptr<TrafficCounters> traffic = nullptr);

  int rank() const {
    return self_;
  }
  int size() const {
    return static_cast<int>(members_.size());
  }
  int transportRank(int commRank) const {
    return members_.at(commRank);
  }

  // Set by the backend before each collective: messages of one collective share its tag.
  void setTag(uint64_t tag) {
    tag_ = tag;
  }
  uint64_t tag() const {
    return tag_;
  }
  // Set by the backend before each collective: every message of it carries the call, so that
  // ranks that called different collectives find out at once.
  void setCall(const CallSignature& call) {
    call_ = call;
  }
  const CallSignature& call() const {
    return call_;
  }
  void setDeadline(Deadline deadline) {
    deadline_ = deadline;
  }
  Deadline deadline() const {
    return deadline_;
  }

  // How the backend ends a failed collective: every send and receive of the group fails (the
  // transport aborts, telling the peers why). Set by the backend; subsets share it.
  using FailureHandler = std::function<void(std::exception_ptr)>;
  void setFailureHandler(FailureHandler handler) {
    onFailure_ = std::make_shared<FailureHandler>(std::move(handler));
  }
  // For an algorithm with a thread of its own that may wait on the transport (the torus column
  // phase): ends the collective for `error` now, so that thread's waits return at once rather
  // than at the deadline, before it is joined. Without a handler, aborts naming the error.
  void fail(std::exception_ptr error) const;

  RequestPtr isend(int peer, const void* buf, size_t nbytes);
  RequestPtr irecv(int peer, void* buf, size_t nbytes);
  void wait(const RequestPtr& request);
  void waitAll(const std::vector<RequestPtr>& requests);

  void send(int peer, const void* buf, size_t nbytes);
  void recv(int peer, void* buf, size_t nbytes);
  // Full duplex: sends to `to` while receiving from `from`.
  void sendRecv(int to, const void* sendBuf, size_t sendBytes, int from, void* recvBuf,
                size_t recvBytes);

  // Shared memory among this Comm's ranks, numbered as the Comm numbers them, when the transport
  // reaches every one of them through it (the whole group on one host, or a torus row on one
  // host of a larger group, over shm or shm+tcp); nullptr otherwise. The same on every rank of
  // the Comm.
  SharedMemory* sharedMemory() const {
    return sharedMemory_.get();
  }

  // Attaches the device arenas of the group's ranks on this host (the backend does, once per
  // device, at its first collective on that device); subsets made later share them.
  void attachDeviceArenas(std::shared_ptr<const DeviceArenas> arenas) {
    deviceArenas_ = std::move(arenas);
  }
  // Every rank's arena, by Comm rank, when every rank of this Comm has one mapped here (all on
  // this host, memory that can be mapped); nullopt otherwise. The same on every rank of the Comm.
  std::optional<ArenaView> deviceArenas() const;

  // A Comm over a subset of this one's ranks (given as this Comm's ranks, in order); this
  // process must be among them. Shares the transport, tag, call and deadline.
  Comm subset(const std::vector<int>& ranks) const;

 private:
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<TrafficCounters> traffic_;
  std::vector<int> members_;
  int self_;
  // Refers into transport_, which outlives it.
  std::shared_ptr<SharedMemory> sharedMemory_;
  std::shared_ptr<const DeviceArenas> deviceArenas_;
  std::shared_ptr<FailureHandler> onFailure_;
  uint64_t tag_ = 0;
  CallSignature call_;
  Deadline deadline_ = Deadline::max();
};

// Reusable scratch memory owned by the caller (one per process group), so that algorithms do
// not allocate on every call. Grows to the largest size asked for; 64-byte aligned.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();
  void* get(size_t nbytes);

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// How algorithms cut their messages: no message carries more than chunkBytes, so the transfer of
// one chunk overlaps the reduction of the previous one.
struct Chunking {
  size_t chunkBytes = 512 * 1024;
};

} // namespace torus
