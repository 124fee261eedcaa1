// ShmTransport: ranks of one host exchange messages through shared memory, and large messages
// with a single copy between the two processes' own buffers.
//
// Each rank creates one segment (a memfd, so it never has a name in /dev/shm) holding its
// control block, the one-shot slots, and one inbound ring per peer. Peers open it through
// /proc/<pid>/fd/<fd> while the creator still holds the fd, map it, and then nobody holds a
// name for it: when the last process that maps it exits — even by SIGKILL — the kernel frees it.
//
// Point-to-point (the Transport interface): a message is a 64-byte header in the receiver's ring
// for the sender, then, for small messages, the payload. A message above kSingleCopyBytes, when
// the receiver can read the sender's memory (process_vm_readv, "CMA"), carries only the sender's
// address: the receiver copies the payload straight from the sender's buffer into its own and
// sends an acknowledgement back, which completes the send. Otherwise the payload streams through
// the ring, so staging is the ring's size however large the message.
//
// Collective support (one_shot and two_shot allreduce): every rank posts {epoch, address, bytes,
// signature} in its control block; peers read one-shot slots directly and, with CMA, each other's
// buffers. Epochs count shm collectives in issue order, which is the same on every rank.
//
// Waiting: spin for a few tens of microseconds yielding the core, then sleep on a futex in the
// waiter's control block ("doorbell"); whoever writes what a rank may wait for bumps that
// rank's doorbell and wakes it if it sleeps. Sleeps last at most kLivenessPeriod, after which
// peers' liveness is checked through pidfds, so a dead peer fails waits instead of hanging them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/rendezvous.h"
#include "transport/polled_transport.h"

namespace torus {

class ShmTransport : public PolledTransport {
 public:
  // Messages above this size go by single copy when the receiver can read the sender's memory.
  static constexpr size_t kSingleCopyBytes = 64 * 1024;
  // Inbound ring per peer.
  static constexpr size_t kRingBytes = 512 * 1024;
  // Each one-shot slot (there are two, used by alternate epochs).
  static constexpr size_t kSlotBytes = 512 * 1024;

  // Ranks are the group's; `members` are the ranks this transport connects (this host's), every
  // rank when empty. Setup is bounded by the rendezvous store's own timeout.
  ShmTransport(int rank, int size, Rendezvous& rendezvous, std::vector<int> members = {});
  ~ShmTransport() override;

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

  // ---- Collective support: for the worker thread that runs the group's collectives. ----

  // True when this rank can read and write every peer's memory (process_vm_readv/writev) and
  // every peer can read this rank's: the condition for two_shot.
  bool singleCopy() const {
    return singleCopy_;
  }
  // True when this transport connects every rank of the group (what postings need).
  bool spansGroup() const {
    return spansGroup_;
  }

  // What a rank announces for one shm collective; peers check that their calls agree.
  struct Posting {
    uint64_t epoch = 0;
    uint64_t address = 0;
    uint64_t nbytes = 0;
    uint64_t tag = 0; // the collective's sequence number, as its messages carry it
    CallSignature call;
  };
  // The next epoch: call once per shm collective, on every rank in the same order.
  uint64_t beginCollective() {
    return ++epoch_;
  }
  // This rank's one-shot slot for `epoch` (kSlotBytes), and a peer's.
  char* slot(int rank, uint64_t epoch) const;
  // Announces this rank's posting and wakes peers.
  void post(const Posting& posting);
  // Waits until `peer` has posted mine.epoch and returns its posting; throws CommError on
  // timeout, abort, the peer's death, or when the peer sends messages of mine.tag with a
  // different call instead (it runs another algorithm or collective).
  Posting waitPosted(int peer, const Posting& mine, Deadline deadline);
  // Copies between this process and a peer's memory (single copy through the kernel).
  void readPeer(int peer, uint64_t address, void* dst, size_t nbytes);
  void writePeer(int peer, uint64_t address, const void* src, size_t nbytes);
  // Counts one delivery into `peer` (a slice written into its buffer) and wakes it.
  void signalDelivered(int peer);
  // Waits for `count` more deliveries into this rank than earlier calls waited for.
  void waitDeliveries(uint64_t count, Deadline deadline);

  struct Op;
  struct Peer;
  struct Segment;

 private:
  void connectAll(Rendezvous& rendezvous, const std::vector<int>& members);
  // Waits, spinning then sleeping on this rank's doorbell, until ready() (called without the
  // transport's lock) returns true. Throws on deadline, abort, a dead or faulted peer; runs
  // whenIdle (if set, with the lock held) after sleeps in which nothing happened.
  template <typename Ready>
  void waitUntil(Ready ready, Deadline deadline, const std::function<std::string()>& waitingFor,
                 const std::function<void()>& whenIdle);
  void progress(std::unique_lock<std::mutex>& lock, Deadline deadline) override;
  bool tryAll() override;
  bool trySend(Peer& peer);
  bool tryRecv(Peer& peer);
  void readSingleCopy(Peer& peer, Op& op, uint64_t address);
  void queueAck(Peer& peer, uint64_t sequence);
  std::shared_ptr<Op> matchPosted(Peer& peer, uint64_t tag);
  void failPending(Peer& peer, CommError::Kind kind, const std::string& why);
  void failPeer(Peer& peer, const std::string& why);
  void checkLiveness();
  // Fails the group when a peer gave up on it (abort()); true when one did.
  bool checkFaults();
  // Fails posted receives whose call disagrees with a held message or a peer's posting of the
  // same tag; true when one failed. Runs when progress found nothing to do for a while.
  bool checkPostedCalls();
  // Fails posted receives of `tag` whose call disagrees with `call`, which `sender` runs there;
  // true when one failed.
  bool failDisagreeing(int sender, uint64_t tag, const CallSignature& call);
  // Sends a probe (kProbeTag) to each peer this rank has been waiting on, once per collective.
  void probeWaits();
  void ring(int peer);

  const int rank_;
  const int size_;
  std::unique_ptr<Segment> self_;
  std::vector<std::unique_ptr<Peer>> peers_; // indexed by rank; null for self
  bool singleCopy_ = false;
  bool spansGroup_ = true;
  uint64_t epoch_ = 0;
  uint64_t deliveriesAwaited_ = 0;

  std::atomic<bool> aborted_{false};
  std::string abortReason_;
  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> anyPeerReceives_;
};

} // namespace torus
