// ShmTransport: ranks of one host exchange messages through shared memory, and large messages
// with a single copy between the two processes' own buffers.
//
// Each rank creates one segment (a memfd, so it never has a name in /dev/shm) holding its
// control block, posting cells and delivery counts per peer, the one-shot slots, and one inbound
// ring per peer. Peers open it through /proc/<pid>/fd/<fd> while the creator still holds the fd,
// map it, and then nobody holds a name for it: when the last process that maps it exits — even
// by SIGKILL — the kernel frees it.
//
// Point-to-point (the Transport interface): a message is a 64-byte header in the receiver's ring
// for the sender, then, for small messages, the payload. A message above kSingleCopyBytes, when
// the receiver can read the sender's memory (process_vm_readv, "CMA"), carries only the sender's
// address: the receiver copies the payload straight from the sender's buffer into its own and
// sends an acknowledgement back, which completes the send. Otherwise the payload streams through
// the ring, so staging is the ring's size however large the message.
//
// Collective support (SharedMemory, for a Comm over ranks this transport connects: the whole
// group, or a torus row on this host): a rank posts {address, bytes, signature} to each peer of a
// collective in a cell of its segment kept for that peer; peers read one-shot slots directly
// and, with CMA, each other's buffers. Epochs count, per pair of ranks, the shm collectives the
// two run together, so that Comms of one host (two torus rows, rows and then a column, the whole
// group) interleave freely: any two ranks run the collectives they share in the same order,
// because each rank runs the group's collectives in issue order (the same on every rank) and
// the phases of one in program order, and two ranks share at most one line of a torus (a row
// peer is never a column peer), so the row and column threads of a torus never count with the
// same peer. Delivery counts are per pair too.
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

#include "transport/polled_transport.h"
#include "transport/rendezvous.h"
#include "transport/shared_memory.h"

namespace torus {

class ShmTransport : public PolledTransport {
 public:
  // Messages above this size go by single copy when the receiver can read the sender's memory.
  static constexpr size_t kSingleCopyBytes = 64 * 1024;
  // Inbound ring per peer.
  static constexpr size_t kRingBytes = 512 * 1024;
  // The one-shot slot size, under the name the backend knows.
  static constexpr size_t kSlotBytes = SharedMemory::kSlotBytes;

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
  std::shared_ptr<SharedMemory> sharedMemory(const std::vector<int>& members,
                                             std::shared_ptr<TrafficCounters> traffic) override;

  // True when this rank can read and write every connected peer's memory (process_vm_readv/
  // writev) and every such peer can read this rank's: the same on every rank it connects.
  bool singleCopy() const {
    return singleCopy_;
  }

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

  // ---- Collective support, in transport ranks, for Members (the SharedMemory of a Comm). ----
  class Members;
  bool connects(int rank) const;
  // The next shm collective this rank runs with `peer`, counted from 1.
  uint64_t nextEpochWith(int peer);
  // The next of all this rank's shm collectives, counted from 1: chooses its slot.
  uint64_t nextOwnEpoch();
  char* claimSlot(uint64_t ownEpoch, int readers, Deadline deadline);
  const char* slot(int rank, uint64_t ownEpoch) const;
  void releaseSlot(int rank, uint64_t ownEpoch);
  // Writes `posting` into the cell this rank keeps for `peer`, as their collective `pairEpoch`.
  void post(int peer, uint64_t pairEpoch, const SharedMemory::Posting& posting);
  SharedMemory::Posting waitPosted(int peer, uint64_t pairEpoch, const SharedMemory::Posting& mine,
                                   Deadline deadline);
  void readPeer(int peer, uint64_t address, void* dst, size_t nbytes);
  void writePeer(int peer, uint64_t address, const void* src, size_t nbytes);
  void signalDelivered(int peer);
  // Waits for one more delivery from each of `peers` than earlier calls waited for.
  void waitDeliveries(const std::vector<int>& peers, Deadline deadline);

  const int rank_;
  const int size_;
  std::unique_ptr<Segment> self_;
  std::vector<std::unique_ptr<Peer>> peers_; // indexed by rank; null for self
  bool singleCopy_ = false;
  // Indexed by rank, each entry touched only by the thread that runs collectives with that peer.
  std::vector<uint64_t> epochsWith_;
  std::vector<uint64_t> deliveriesAwaited_;
  std::atomic<uint64_t> ownEpoch_{0};
  // Releases each slot is owed by the peers that read it, ever; claims are serialized.
  std::mutex slotMutex_;
  uint64_t slotReadsOwed_[2] = {0, 0};

  std::atomic<bool> aborted_{false};
  std::string abortReason_;
  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> anyPeerReceives_;
};

} // namespace torus
