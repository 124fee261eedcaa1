// TcpTransport: one TCP connection to every other rank, driven by a poll() progress engine.
//
// Connections are made eagerly when the group is created (lower rank accepts, higher rank
// connects), so a dead or missing peer shows up at init rather than as a hang in the middle of a
// job. On the wire each message is a 32-byte header {tag, nbytes, call signature} followed by
// the payload.
// A receive posted before its message arrives gets the payload straight into its buffer; a
// message that arrives first is held in a heap buffer until its receive is posted (collectives
// cut their messages into chunks, which bounds that buffer).
//
// Progress has no thread of its own: whichever thread waits drives all pending sends and
// receives; other waiters sleep on a condition variable until the driving thread completes
// something. Waits spin for a few tens of microseconds, yielding the core, then sleep in poll(),
// so oversubscribed hosts are not burned by spinning.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/rendezvous.h"
#include "transport/polled_transport.h"

namespace torus {

struct TcpOptions {
  // Address to listen on and to publish to peers, e.g. "127.0.0.1" or an interface's address.
  std::string address = "127.0.0.1";
  // Bounds connection setup.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
};

class TcpTransport : public PolledTransport {
 public:
  TcpTransport(int rank, int size, Rendezvous& rendezvous, const TcpOptions& options);
  ~TcpTransport() override;

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }

  RequestPtr isend(int peer, uint64_t tag, const CallSignature& call, const void* buf, size_t nbytes) override;
  RequestPtr irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) override;
  void abort(const std::string& why) override;
  std::optional<StrayMessage> strayMessage(uint64_t upToTag) override;

  struct Op;
  struct Pair;

 private:
  void connectAll(Rendezvous& rendezvous, Deadline deadline, const std::string& address);
  void progress(std::unique_lock<std::mutex>& lock, Deadline deadline) override;
  // One non-blocking attempt on every connection; true when some request completed.
  bool tryAll() override;
  bool trySend(Pair& pair);
  bool tryRecv(Pair& pair);
  void deliver(Pair& pair, uint64_t tag, const CallSignature& call, std::vector<char>&& payload);
  // Fails posted receives whose call disagrees with a held message of the same tag; true when
  // one failed. Runs when progress found nothing to do for a while.
  bool checkHeldCalls();
  // Fails posted receives of `tag` whose call disagrees with `call`, which `sender` runs there;
  // true when one failed.
  bool failDisagreeing(int sender, uint64_t tag, const CallSignature& call);
  // Sends a probe (kProbeTag) to each peer this rank has been waiting on, once per collective.
  void probeWaits();
  void tellFault(Pair& pair, const std::string& why);
  std::shared_ptr<Op> matchPosted(Pair& pair, uint64_t tag);
  void failPending(Pair& pair, CommError::Kind kind, const std::string& why);
  void failPair(Pair& pair, const std::string& why);
  void wake();

  const int rank_;
  const int size_;
  int listenFd_ = -1;
  int wakeFd_ = -1;
  std::vector<std::unique_ptr<Pair>> pairs_; // indexed by peer rank; null for self

  std::string abortReason_;
  // Receives from any peer, per tag, in posting order.
  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> anyPeerReceives_;
};

} // namespace torus
