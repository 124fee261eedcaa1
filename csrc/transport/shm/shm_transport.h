// ShmTransport: ranks of one host exchange messages through shared memory, and large messages
// with a single copy between the two processes' own buffers.
//
// Each rank creates one segment (a memfd, so it never has a name in /dev/shm) holding its
// control block, posting cells and delivery counts per peer, the one-shot slots, and one inbound
// ring per peer. Peers open it through /proc/<pid>/fd/<fd> while the creator still holds the fd,
// map it, and then nobody holds a name for it: when the last process that maps it exits — even
// by SIGKILL — the kernel frees it.
//
// Point-to-point (the Transport interface): the message layer (MessageTransport) frames and
// matches messages on one ring per direction: the receiver's inbound ring for the sender, a
// byte stream. A message above kSingleCopyBytes, when the receiver can read the sender's memory
// (process_vm_readv, "CMA"), carries only the sender's address: the receiver copies the payload
// straight from the sender's buffer into its own once its receive is posted, a bounded piece at a
// time with the transport's lock released, stopping when the sender gives up (peer_memory.h).
// Otherwise the payload streams through the ring, so staging is the ring's size however large
// the message. The segment's layout: shm_segment.h; the Link over the rings: ring_link.h.
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
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/message_transport.h"
#include "transport/rendezvous.h"
#include "transport/shared_memory.h"
#include "transport/shm/huge_page_backing.h"
#include "transport/spin_wait.h"

namespace torus {

class ShmTransport : public MessageTransport {
 public:
  // Messages above this size go by single copy when the receiver can read the sender's memory.
  static constexpr size_t kSingleCopyBytes = 64 * 1024;
  // Inbound ring per peer.
  static constexpr size_t kRingBytes = 512 * 1024;
  // The one-shot slot size, under the name the backend knows.
  static constexpr size_t kSlotBytes = SharedMemory::kSlotBytes;

  // Ranks are the group's; `members` are the ranks this transport connects (this host's), every
  // rank when empty. Setup reads the peers' keys in two batched store operations, however many
  // they are, and is bounded by the rendezvous store's own timeout.
  ShmTransport(int rank, int size, Rendezvous& rendezvous, std::vector<int> members = {},
               MessageOptions messages = {}, WaitPolicy wait = WaitPolicy::kAuto);
  ~ShmTransport() override;

  std::shared_ptr<SharedMemory> sharedMemory(const std::vector<int>& members,
                                             std::shared_ptr<TrafficCounters> traffic) override;

  // True when this rank can read and write every connected peer's memory (process_vm_readv/
  // writev) and every such peer can read this rank's: the same on every rank it connects.
  bool singleCopy() const {
    return singleCopy_;
  }

  struct Peer;
  struct Segment;
  class RingLink;

 private:
  void connectAll(Rendezvous& rendezvous, const std::vector<int>& members);
  // Waits, spinning then sleeping on this rank's doorbell, until ready() (called without the
  // transport's lock) returns true. Throws on deadline, abort, a dead or faulted peer; runs
  // whenIdle (if set, with the lock held) after sleeps in which nothing happened.
  template <typename Ready>
  void waitUntil(Ready ready, Deadline deadline, const std::function<std::string()>& waitingFor,
                 const std::function<void()>& whenIdle);
  bool sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) override;
  // Copies a piece of each single-copy receive under way (RingLink, SingleCopyRead).
  bool workOutsideLock(std::unique_lock<std::mutex>& lock) override;
  void wakeSleeper() override;
  bool checkPeers() override;
  void whenIdle() override;
  void announceAbort(const std::string& why) override;
  bool readsCheaply() const override {
    return true;
  }
  void checkLiveness();
  // shareCores() at most every SpinWait::kCoresPeriod.
  void refreshCores();
  // Publishes this rank's affinity and tells spin_ the host's ranks' cores (their masks' union).
  void shareCores();
  // Publishes the core this rank runs on; true when a peer here last waited on the same one: it
  // runs, or will, only when this rank leaves the core.
  bool peerSharesCore();
  // Fails posted receives whose call disagrees with a peer's posting of the same tag.
  void checkPostings();
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
  // Before this rank posts its buffer for peers to copy from and into (HugePageBacking).
  void prepareForPeers(uint64_t address, size_t nbytes) {
    hugePages_.prepare(address, nbytes);
  }
  SharedMemory::Posting waitPosted(int peer, uint64_t pairEpoch, const SharedMemory::Posting& mine,
                                   Deadline deadline);
  void readPeer(int peer, uint64_t address, void* dst, size_t nbytes);
  void writePeer(int peer, uint64_t address, const void* src, size_t nbytes);
  // `posting` (from `peer`, naming a shared tensor segment) mapped into this process: null when
  // the kernel will not open or map the segment. Throws CommError when the posting contradicts
  // itself or the segment it names.
  char* mapPostedBuffer(int peer, const SharedMemory::Posting& posting);
  // Unmaps the peer's segments whose fd no longer names the file mapped (it gave them back), and
  // notes releasedSegments, the count it posted, as seen.
  void dropReleasedSegments(int peer, uint64_t releasedSegments);
  void useMapped(int peer, const std::function<void()>& use);
  void signalDelivered(int peer);
  // Throws kAborted once this rank gave up on the group.
  void throwIfAborted();
  // Waits for one more delivery from each of `peers` than earlier calls waited for.
  void waitDeliveries(const std::vector<int>& peers, Deadline deadline);

  // What a wait does between looks (TORUS_WAIT), with this host's ranks and their cores.
  SpinWait spin_;
  std::vector<int> members_;
  // When refreshCores next reads the affinity, in Clock ticks.
  std::atomic<int64_t> coresDue_{0};
  std::unique_ptr<Segment> self_;
  std::vector<std::unique_ptr<Peer>> peers_; // indexed by rank; null for self
  bool singleCopy_ = false;
  // Indexed by rank, each entry touched only by the thread that runs collectives with that peer.
  std::vector<uint64_t> epochsWith_;
  std::vector<uint64_t> deliveriesAwaited_;
  HugePageBacking hugePages_;
  std::atomic<uint64_t> ownEpoch_{0};
  // Releases each slot is owed by the peers that read it, ever; claims are serialized.
  std::mutex slotMutex_;
  uint64_t slotReadsOwed_[2] = {0, 0};

  std::atomic<bool> aborted_{false};
};

} // namespace torus
