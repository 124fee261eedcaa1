// TcpTransport: one TCP connection to every other rank, under the message layer
// (MessageTransport), which frames, matches and flow-controls the messages on it.
//
// Connections are made eagerly when the group is created (lower rank accepts, higher rank
// connects), so a dead or missing peer shows up at init rather than as a hang in the middle of a
// job. A payload the receiver has not asked for waits in the sender's buffer past the eager
// window, so the kernel's flow control holds the rest.
//
// Progress has no thread of its own: whichever thread waits drives all pending sends and
// receives; other waiters sleep on a condition variable until the driving thread completes
// something. Waits spin for a few tens of microseconds, yielding the core, then sleep in poll(),
// so oversubscribed hosts are not burned by spinning.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/rendezvous.h"
#include "transport/message_transport.h"

namespace torus {

struct TcpOptions {
  // Address to listen on and to publish to peers, e.g. "127.0.0.1" or an interface's address.
  std::string address = "127.0.0.1";
  // Bounds connection setup.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  MessageOptions messages;
};

class TcpTransport : public MessageTransport {
 public:
  TcpTransport(int rank, int size, Rendezvous& rendezvous, const TcpOptions& options);
  ~TcpTransport() override;

  struct Pair;

 private:
  void connectAll(Rendezvous& rendezvous, Deadline deadline, const std::string& address);
  bool sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) override;
  void wakeSleeper() override;
  void announceAbort(const std::string& why) override;

  int listenFd_ = -1;
  int wakeFd_ = -1;
  std::vector<std::unique_ptr<Pair>> pairs_; // indexed by peer rank; null for self
};

} // namespace torus
