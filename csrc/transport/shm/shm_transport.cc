#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

#include "transport/shm/shared_tensor_arena.h"

namespace torus {

namespace {

constexpr uint64_t kSegmentMagic = 0x746f7275732d7368; // "torus-sh"
constexpr size_t kLine = 64;
// The longest a wait sleeps before it checks that its peers are alive.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
// How long a wait for peers spins (SpinWait: pausing, or yielding the core where ranks outnumber
// cores) before it sleeps on the doorbell.
// Longer than kSpinBeforeSleep: against 50 and 500 µs, pause-spinning first and sleeping at once,
// 200 µs was as fast or faster at 2, 4 and 8 ranks on 2 cores (BENCHMARKS.md, "Waiting on
// shared memory").
constexpr auto kSpinBeforeSleepOnPeers = std::chrono::microseconds(200);

// One posting cell: what the segment's owner announced to one peer for their collective `epoch`.
struct alignas(kLine) SharedPosting {
  std::atomic<uint64_t> epoch; // counted per pair of ranks
  uint64_t ownEpoch; // the owner's own count: names its slot
  uint64_t address;
  uint64_t nbytes;
  uint64_t tag;
  CallSignature call;
  int64_t segmentFd; // the owner's SharedTensorArena segment holding the buffer; -1: none
  uint64_t segmentBase;
  uint64_t segmentBytes;
};

struct ControlBlock {
  uint64_t magic;
  int32_t pid;
  // The cores the owner may run on (its affinity mask when it connected).
  cpu_set_t cores;
  // Set when the owner destroys its transport: its exit afterwards is a departure, not a death.
  std::atomic<uint32_t> left;
  // Set when the owner gives up on the group (abort()); faultText says why.
  std::atomic<uint32_t> faulted;
  char faultText[kFaultTextBytes];
  alignas(kLine) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleepers;
  // Peers that finished reading each one-shot slot, ever.
  alignas(kLine) std::atomic<uint64_t> slotReleases[2];
  // Peers reading or writing the owner's memory right now (guardedPeerAccess).
  alignas(kLine) std::atomic<uint32_t> crossCopiers;
};

// Deliveries into the segment's owner from one peer, ever.
struct alignas(kLine) DeliveryCount {
  std::atomic<uint64_t> count;
};

// Written by one peer (the producer), read by the segment's owner.
struct SharedRing {
  alignas(kLine) std::atomic<uint64_t> head; // bytes written, ever
  alignas(kLine) std::atomic<uint64_t> tail; // bytes consumed, ever
  alignas(kLine) std::atomic<uint32_t> producerWaiting;
  alignas(kLine) char data[ShmTransport::kRingBytes];
};

constexpr size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}
// A segment of a group of `size` ranks: the control block; two posting cells per rank (the
// owner's announcements to that peer, for alternate collectives of the pair); the deliveries from
// each rank; the two one-shot slots; one inbound ring per rank.
constexpr size_t kPostingsOffset = roundUp(sizeof(ControlBlock), kLine);

size_t deliveriesOffset(int size) {
  return kPostingsOffset + 2 * static_cast<size_t>(size) * sizeof(SharedPosting);
}

size_t slotsOffset(int size) {
  return roundUp(deliveriesOffset(size) + static_cast<size_t>(size) * sizeof(DeliveryCount), 4096);
}

size_t ringsOffset(int size) {
  return slotsOffset(size) + 2 * ShmTransport::kSlotBytes;
}

size_t segmentBytes(int size) {
  return ringsOffset(size) + static_cast<size_t>(size) * sizeof(SharedRing);
}

std::string systemError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Tells the owner of `control` that something it may wait for changed, waking it if it sleeps.
void ringDoorbell(ControlBlock* control) {
  control->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (control->sleepers.load(std::memory_order_seq_cst) > 0) {
    futexWake(&control->doorbell);
  }
}

std::chrono::nanoseconds sleepFor(Deadline deadline) {
  auto left = deadline == Deadline::max() ? std::chrono::nanoseconds(kLivenessPeriod) : deadline - Clock::now();
  return std::max(std::chrono::nanoseconds(0),
                  std::min<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(kLivenessPeriod)));
}

// Copies n bytes into a ring at position pos (which may wrap), or out of it.
void copyIn(char* ring, uint64_t pos, const char* src, size_t n) {
  size_t at = pos % ShmTransport::kRingBytes;
  size_t first = std::min(n, ShmTransport::kRingBytes - at);
  std::memcpy(ring + at, src, first);
  std::memcpy(ring, src + first, n - first);
}

void copyOut(char* dst, const char* ring, uint64_t pos, size_t n) {
  size_t at = pos % ShmTransport::kRingBytes;
  size_t first = std::min(n, ShmTransport::kRingBytes - at);
  std::memcpy(dst, ring + at, first);
  std::memcpy(dst + first, ring, n - first);
}

// Moves nbytes between this process's `local` and another process's `remote` address, by
// process_vm_readv (read) or process_vm_writev; false, with errno set, when the kernel refuses.
bool crossCopy(int pid, char* local, uint64_t remote, size_t nbytes, bool read) {
  size_t done = 0;
  while (done < nbytes) {
    iovec here{local + done, nbytes - done};
    iovec there{reinterpret_cast<void*>(remote + done), nbytes - done};
    ssize_t moved = read ? ::process_vm_readv(pid, &here, 1, &there, 1, 0) : ::process_vm_writev(pid, &here, 1, &there, 1, 0);
    if (moved <= 0) {
      return false;
    }
    done += static_cast<size_t>(moved);
  }
  return true;
}

// "rank R gave up on the group: <why>", from the control block of rank R, which gave up.
std::string gaveUpText(const ControlBlock* control, int rank) {
  return "rank " + std::to_string(rank) + " gave up on the group: " +
         std::string(control->faultText, ::strnlen(control->faultText, kFaultTextBytes));
}

// Runs access() on the memory of the peer whose control block is `peer`, unless the peer has given
// up on the group: its abort() then waits for accesses under way, so that it reuses no buffer an
// access still touches. Throws CommError naming `peerRank` when the peer gave up, or when access()
// returns false (the kernel refused a copy; errno says why, `what` says what was refused).
template <typename Access>
void guardedPeerAccess(ControlBlock* peer, int peerRank, const char* what, Access access) {
  struct Counted {
    ControlBlock* peer;
    ~Counted() {
      peer->crossCopiers.fetch_sub(1, std::memory_order_release);
    }
  };
  peer->crossCopiers.fetch_add(1, std::memory_order_seq_cst);
  bool gaveUp = false;
  bool done = false;
  int err = 0;
  {
    Counted counted{peer};
    gaveUp = peer->faulted.load(std::memory_order_seq_cst) != 0;
    done = !gaveUp && access();
    err = errno;
  }
  if (gaveUp) {
    throw CommError(CommError::Kind::kPeer, gaveUpText(peer, peerRank));
  }
  if (!done) {
    errno = err;
    throw CommError(CommError::Kind::kPeer,
                    systemError(std::string("cannot ") + what + " rank " + std::to_string(peerRank) + "'s memory"));
  }
}

// Moves nbytes between this process's `local` and the memory of the peer whose control block is
// `peer` (its pid `pid`), under guardedPeerAccess.
void guardedCrossCopy(ControlBlock* peer, int pid, int peerRank, char* local, uint64_t remote, size_t nbytes,
                      bool read) {
  guardedPeerAccess(peer, peerRank, read ? "read" : "write",
                    [&] { return crossCopy(pid, local, remote, nbytes, read); });
}

// How long abort() waits for peers' copies from or into this rank's memory to finish.
constexpr auto kCrossCopyDrain = std::chrono::seconds(2);

} // namespace

// A mapping of one rank's segment (this rank's own, or a peer's).
struct ShmTransport::Segment {
  char* base = nullptr;
  size_t bytes = 0;
  int groupSize = 0;

  ~Segment() {
    if (base != nullptr) {
      ::munmap(base, bytes);
    }
  }
  ControlBlock* control() const {
    return reinterpret_cast<ControlBlock*>(base);
  }
  // The cell the owner posts to `reader` in for their collective `pairEpoch`.
  SharedPosting* posting(int reader, uint64_t pairEpoch) const {
    return reinterpret_cast<SharedPosting*>(base + kPostingsOffset) + 2 * reader + (pairEpoch & 1);
  }
  DeliveryCount* deliveries(int from) const {
    return reinterpret_cast<DeliveryCount*>(base + deliveriesOffset(groupSize)) + from;
  }
  char* slot(uint64_t ownEpoch) const {
    return base + slotsOffset(groupSize) + (ownEpoch & 1) * kSlotBytes;
  }
  // The ring that rank `producer` writes into this segment.
  SharedRing* ring(int producer) const {
    return reinterpret_cast<SharedRing*>(base + ringsOffset(groupSize)) + producer;
  }
};

// The message layer's Link to one peer: this rank's ring in the peer's segment out, the peer's
// ring in this rank's segment in, and the peer's memory by process_vm_readv.
class ShmTransport::RingLink : public Link {
 public:
  RingLink(SharedRing* out, SharedRing* in, ControlBlock* peerControl, int pid, int peerRank, bool peerReads)
      : out_(out), in_(in), peerControl_(peerControl), pid_(pid), peerRank_(peerRank), peerReads_(peerReads) {}

  size_t write(const iovec* parts, int count) override {
    size_t wanted = 0;
    for (int i = 0; i < count; ++i) {
      wanted += parts[i].iov_len;
    }
    uint64_t free = freeBytes(out_->tail.load(std::memory_order_acquire));
    if (free < wanted) {
      // Ask the consumer to ring us when it frees space, then look again in case it just did.
      out_->producerWaiting.store(1, std::memory_order_seq_cst);
      free = freeBytes(out_->tail.load(std::memory_order_seq_cst));
    }
    size_t took = 0;
    for (int i = 0; i < count && free > 0; ++i) {
      const size_t n = std::min<size_t>(free, parts[i].iov_len);
      copyIn(out_->data, sendPos_, static_cast<const char*>(parts[i].iov_base), n);
      sendPos_ += n;
      free -= n;
      took += n;
    }
    return took;
  }

  ssize_t read(char* dst, size_t n) override {
    const uint64_t head = in_->head.load(std::memory_order_acquire);
    const uint64_t available = head - recvPos_;
    // The peer writes the head in this rank's segment: a head behind what was read, or ahead by
    // more than the ring holds, would copy from past the ring.
    if (head < recvPos_ || available > kRingBytes) {
      brokeRing("head", head, "read", recvPos_);
    }
    const size_t got = std::min<uint64_t>(n, available);
    copyOut(dst, in_->data, recvPos_, got);
    recvPos_ += got;
    return static_cast<ssize_t>(got);
  }

  void flush() override {
    out_->head.store(sendPos_, std::memory_order_release);
    ringDoorbell(peerControl_);
  }

  void consumed() override {
    in_->tail.store(recvPos_, std::memory_order_seq_cst);
    if (in_->producerWaiting.exchange(0, std::memory_order_seq_cst) != 0) {
      ringDoorbell(peerControl_);
    }
  }

  size_t peerReadsAbove() const override {
    return peerReads_ ? kSingleCopyBytes : SIZE_MAX;
  }

  // One copy by the kernel, never a wait: done when startRead returns (continueRead: true).
  void startRead(uint64_t address, uint64_t key, char* dst, size_t n) override {
    guardedCrossCopy(peerControl_, pid_, peerRank_, dst, address, n, true);
  }

 private:
  // Room in the ring out, given the consumer's tail, which the peer writes in its segment: a tail
  // ahead of what was written, or behind it by more than the ring holds, would copy past the ring.
  uint64_t freeBytes(uint64_t tail) const {
    if (tail > sendPos_ || sendPos_ - tail > kRingBytes) {
      brokeRing("tail", tail, "written", sendPos_);
    }
    return kRingBytes - (sendPos_ - tail);
  }

  // The peer set its ring's `field` to `theirs`, which no write of its could have, `ours` bytes
  // having been `done` here: fails the peer.
  [[noreturn]] void brokeRing(const char* field, uint64_t theirs, const char* done, uint64_t ours) const {
    throw CommError(CommError::Kind::kPeer, rankName(peerRank_) + " broke the wire protocol: its ring's " + field +
                                                " is at byte " + std::to_string(theirs) + " where " +
                                                std::to_string(ours) + " were " + done + " and the ring holds " +
                                                std::to_string(kRingBytes));
  }

  SharedRing* out_;
  SharedRing* in_;
  ControlBlock* peerControl_;
  int pid_;
  int peerRank_;
  bool peerReads_;
  uint64_t sendPos_ = 0;
  uint64_t recvPos_ = 0;
};

struct ShmTransport::Peer {
  int rank = -1;
  int pid = 0;
  int pidfd = -1;
  Segment segment;
  // The peer reads single-copy messages from this process.
  bool readsSingleCopy = false;
  std::unique_ptr<RingLink> link;
  // The peer's SharedTensorArena segments mapped here, by the peer's fd; touched only by the
  // thread that runs collectives with the peer, as epochsWith_ is.
  struct TensorSegment {
    char* local;
    uint64_t base; // in the peer's address space
    uint64_t bytes;
  };
  std::map<int64_t, TensorSegment> tensorSegments;

  ~Peer() {
    if (pidfd >= 0) {
      ::close(pidfd);
    }
    for (const auto& [fd, segment] : tensorSegments) {
      ::munmap(segment.local, segment.bytes);
    }
  }
};

ShmTransport::ShmTransport(int rank, int size, Rendezvous& rendezvous, std::vector<int> members,
                           MessageOptions messages)
    : MessageTransport(rank, size, messages),
      self_(std::make_unique<Segment>()),
      peers_(static_cast<size_t>(size)),
      epochsWith_(static_cast<size_t>(size), 0),
      deliveriesAwaited_(static_cast<size_t>(size), 0) {
  if (members.empty()) {
    members.resize(static_cast<size_t>(size));
    std::iota(members.begin(), members.end(), 0);
  }
  connectAll(rendezvous, members);
  joinHelper();
}

ShmTransport::~ShmTransport() {
  leaveHelper();
  if (self_->base != nullptr) {
    self_->control()->left.store(1, std::memory_order_seq_cst);
    for (auto& peer : peers_) {
      if (peer) {
        ring(peer->rank);
      }
    }
  }
}

void ShmTransport::connectAll(Rendezvous& rendezvous, const std::vector<int>& members) {
  const size_t bytes = segmentBytes(size());
  int fd = ::memfd_create(("torus-rank" + std::to_string(rank())).c_str(), MFD_CLOEXEC);
  if (fd < 0) {
    throw CommError(CommError::Kind::kPeer, systemError("torus: memfd_create"));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() {
      ::close(fd);
    }
  } closer{fd};
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    throw CommError(CommError::Kind::kPeer, systemError("torus: cannot size the shared memory segment"));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    throw CommError(CommError::Kind::kPeer, systemError("torus: cannot map the shared memory segment"));
  }
  self_->base = static_cast<char*>(base);
  self_->bytes = bytes;
  self_->groupSize = size();
  self_->control()->magic = kSegmentMagic;
  self_->control()->pid = static_cast<int32_t>(::getpid());
  cpu_set_t cores = SpinWait::usableCores();
  self_->control()->cores = cores;
  std::ostringstream mine;
  mine << ::getpid() << ' ' << fd << ' ' << bytes << ' ' << reinterpret_cast<uintptr_t>(base);
  rendezvous.set("shm/" + std::to_string(rank()), mine.str());

  // Every peer's segment is read in one store operation (and their readiness in one more), so
  // setup costs a rank the same store operations at 4 ranks on its host as at 64.
  std::vector<int> peerRanks;
  std::vector<std::string> segmentKeys;
  std::vector<std::string> readyKeys;
  for (int r : members) {
    if (r != rank()) {
      peerRanks.push_back(r);
      segmentKeys.push_back("shm/" + std::to_string(r));
      readyKeys.push_back("shm/ready/" + std::to_string(r));
    }
  }
  const std::vector<std::string> segments = rendezvous.multiGet(segmentKeys);
  bool readsAll = true;
  for (size_t i = 0; i < peerRanks.size(); ++i) {
    const int r = peerRanks[i];
    auto peer = std::make_unique<Peer>();
    peer->rank = r;
    std::istringstream theirs(segments[i]);
    int peerFd = -1;
    size_t peerBytes = 0;
    uintptr_t peerBase = 0;
    theirs >> peer->pid >> peerFd >> peerBytes >> peerBase;
    const std::string path = "/proc/" + std::to_string(peer->pid) + "/fd/" + std::to_string(peerFd);
    int mapped = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (mapped < 0) {
      throw CommError(CommError::Kind::kPeer,
                      systemError("torus: rank " + std::to_string(rank()) + " cannot open rank " + std::to_string(r) +
                                  "'s shared memory (" + path + "); shared memory needs the ranks on one host in one "
                                  "pid namespace (TORUS_HOST_ID may have grouped ranks that are not): set "
                                  "TORUS_TRANSPORT=tcp"));
    }
    void* at = ::mmap(nullptr, peerBytes, PROT_READ | PROT_WRITE, MAP_SHARED, mapped, 0);
    ::close(mapped);
    if (at == MAP_FAILED || peerBytes != bytes) {
      throw CommError(CommError::Kind::kPeer, "torus: cannot map rank " + std::to_string(r) + "'s shared memory");
    }
    peer->segment.base = static_cast<char*>(at);
    peer->segment.bytes = peerBytes;
    peer->segment.groupSize = size();
    if (peer->segment.control()->magic != kSegmentMagic) {
      throw CommError(CommError::Kind::kPeer, "torus: rank " + std::to_string(r) + "'s shared memory is not a torus "
                                              "segment");
    }
    const cpu_set_t theirCores = peer->segment.control()->cores;
    CPU_OR(&cores, &cores, &theirCores);
    peer->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, peer->pid, 0));
    // Can this process read the peer's memory directly? Probe with the peer's magic number.
    uint64_t probe = 0;
    readsAll = readsAll && crossCopy(peer->pid, reinterpret_cast<char*>(&probe), peerBase, sizeof(probe), true) &&
               probe == kSegmentMagic;
    peers_[r] = std::move(peer);
  }
  spin_ = SpinWait(static_cast<int>(members.size()), CPU_COUNT(&cores));
  // Every rank has mapped every segment once all have published this key, so the fds (the only
  // handles left besides the mappings) can close.
  rendezvous.set("shm/ready/" + std::to_string(rank()), readsAll ? "1" : "0");
  singleCopy_ = readsAll;
  const std::vector<std::string> ready = rendezvous.multiGet(readyKeys);
  for (size_t i = 0; i < peerRanks.size(); ++i) {
    Peer& peer = *peers_[peerRanks[i]];
    peer.readsSingleCopy = ready[i] == "1";
    singleCopy_ = singleCopy_ && peer.readsSingleCopy;
    peer.link = std::make_unique<RingLink>(peer.segment.ring(rank()), self_->ring(peer.rank), peer.segment.control(),
                                           peer.pid, peer.rank, peer.readsSingleCopy);
    attach(peer.rank, peer.link.get());
  }
}

void ShmTransport::ring(int rank) {
  ringDoorbell(rank == this->rank() ? self_->control() : peers_[rank]->segment.control());
}

void ShmTransport::checkLiveness() {
  for (auto& peer : peers_) {
    if (!peer || !peerFailure(peer->rank).empty()) {
      continue;
    }
    if (peer->segment.control()->left.load(std::memory_order_acquire) != 0) {
      // Requests still owed by a rank that destroyed its group fail; the group lives on.
      peerLeft(peer->rank, "rank " + std::to_string(peer->rank) + " left the group (destroyed its process group)");
      continue;
    }
    pollfd pfd{peer->pidfd, POLLIN, 0};
    if (peer->pidfd >= 0 && ::poll(&pfd, 1, 0) > 0) {
      failPeer(peer->rank, "rank " + std::to_string(peer->rank) + " (pid " + std::to_string(peer->pid) +
                               ") exited: the process ended or was killed");
    }
  }
}

bool ShmTransport::checkPeers() {
  // A peer that gave up on the group (abort()) says why in its control block.
  bool failed = false;
  for (auto& peer : peers_) {
    if (peer && peerFailure(peer->rank).empty() &&
        peer->segment.control()->faulted.load(std::memory_order_acquire) != 0) {
      failPeer(peer->rank, gaveUpText(peer->segment.control(), peer->rank));
      failed = true;
    }
  }
  return failed;
}

void ShmTransport::checkPostings() {
  // A receive posted for a collective while another rank announced a shared-memory collective of
  // that sequence number with a different call: the ranks called different collectives.
  for (auto& peer : peers_) {
    if (!peer) {
      continue;
    }
    for (uint64_t parity : {0, 1}) {
      const SharedPosting& posting = *peer->segment.posting(rank(), parity);
      if (posting.epoch.load(std::memory_order_acquire) != 0) {
        failDisagreeing(peer->rank, posting.tag, posting.call);
      }
    }
  }
}

void ShmTransport::whenIdle() {
  checkLiveness();
  checkPostings();
}

bool ShmTransport::sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  ControlBlock* control = self_->control();
  const uint32_t seen = control->doorbell.load(std::memory_order_seq_cst);
  control->sleepers.fetch_add(1, std::memory_order_seq_cst);
  bool happened = tryAll() || aborted_.load();
  if (!happened) {
    lock.unlock();
    futexWait(&control->doorbell, seen, sleepFor(deadline));
    lock.lock();
    happened = control->doorbell.load(std::memory_order_seq_cst) != seen;
  }
  control->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return happened;
}

void ShmTransport::wakeSleeper() {
  ring(rank());
}

void ShmTransport::announceAbort(const std::string& why) {
  aborted_.store(true);
  ControlBlock* control = self_->control();
  const size_t n = std::min(why.size(), kFaultTextBytes - 1);
  std::memcpy(control->faultText, why.data(), n);
  control->faultText[n] = '\0';
  control->faulted.store(1, std::memory_order_seq_cst);
  for (auto& peer : peers_) {
    if (peer) {
      ring(peer->rank);
    }
  }
  // Peers' copies from or into this rank's buffers end before abort() returns and the buffers
  // go; a peer that does not finish in time is stuck anyway.
  const Deadline drained = Clock::now() + kCrossCopyDrain;
  while (control->crossCopiers.load(std::memory_order_seq_cst) != 0 && Clock::now() < drained) {
    std::this_thread::yield();
  }
}

// ---- Collective support ----

bool ShmTransport::connects(int rank) const {
  return rank == this->rank() || (rank >= 0 && rank < size() && peers_[rank] != nullptr);
}

uint64_t ShmTransport::nextEpochWith(int peer) {
  return ++epochsWith_[peer];
}

uint64_t ShmTransport::nextOwnEpoch() {
  return ownEpoch_.fetch_add(1) + 1;
}

char* ShmTransport::claimSlot(uint64_t ownEpoch, int readers, Deadline deadline) {
  // A slot's readers may still read it after this rank has moved on (one_shot does not wait for
  // them), and, in a subset Comm, after it has run collectives without them: each releases the
  // slot once done, and a claim waits for the releases owed by the slot's previous use.
  const size_t parity = ownEpoch & 1;
  std::lock_guard<std::mutex> claiming(slotMutex_);
  std::atomic<uint64_t>& released = self_->control()->slotReleases[parity];
  const uint64_t owed = slotReadsOwed_[parity];
  waitUntil([&] { return released.load(std::memory_order_acquire) >= owed; }, deadline,
            [&] { return std::to_string(owed - released.load()) + " peer(s) to finish reading a one-shot slot"; },
            nullptr);
  slotReadsOwed_[parity] += static_cast<uint64_t>(readers);
  return self_->slot(ownEpoch);
}

const char* ShmTransport::slot(int rank, uint64_t ownEpoch) const {
  return rank == this->rank() ? self_->slot(ownEpoch) : peers_[rank]->segment.slot(ownEpoch);
}

void ShmTransport::releaseSlot(int rank, uint64_t ownEpoch) {
  peers_[rank]->segment.control()->slotReleases[ownEpoch & 1].fetch_add(1, std::memory_order_release);
  ring(rank);
}

void ShmTransport::post(int peer, uint64_t pairEpoch, const SharedMemory::Posting& posting) {
  // The cell of pairEpoch - 2 is free: this rank reached pairEpoch - 1 with the peer only after
  // the peer had posted it, which the peer did after it finished pairEpoch - 2.
  SharedPosting& shared = *self_->posting(peer, pairEpoch);
  shared.ownEpoch = posting.epoch;
  shared.address = posting.address;
  shared.nbytes = posting.nbytes;
  shared.tag = posting.tag;
  shared.call = posting.call;
  shared.segmentFd = posting.segmentFd;
  shared.segmentBase = posting.segmentBase;
  shared.segmentBytes = posting.segmentBytes;
  shared.epoch.store(pairEpoch, std::memory_order_release);
  ring(peer);
}

template <typename Ready>
void ShmTransport::waitUntil(Ready ready, Deadline deadline, const std::function<std::string()>& waitingFor,
                             const std::function<void()>& whenIdle) {
  const auto spinUntil = Clock::now() + kSpinBeforeSleepOnPeers;
  while (Clock::now() < spinUntil) {
    if (ready()) {
      return;
    }
    spin_.relax();
  }
  ControlBlock* control = self_->control();
  for (;;) {
    if (ready()) {
      return;
    }
    throwIfAborted();
    if (Clock::now() >= deadline) {
      throw CommError(CommError::Kind::kTimeout, "timed out waiting for " + waitingFor());
    }
    const uint32_t seen = control->doorbell.load(std::memory_order_seq_cst);
    control->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!ready()) {
      futexWait(&control->doorbell, seen, sleepFor(deadline));
    }
    control->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    std::lock_guard<std::mutex> lock(mutex_);
    checkPeers();
    if (control->doorbell.load(std::memory_order_seq_cst) == seen) {
      // Nothing happened for a while: is everyone we may be waiting for still alive, and still
      // in the same collective?
      checkLiveness();
      if (whenIdle) {
        whenIdle();
      }
    }
    for (auto& peer : peers_) {
      if (peer && !peerFailure(peer->rank).empty()) {
        throw CommError(CommError::Kind::kPeer, peerFailure(peer->rank));
      }
    }
  }
}

SharedMemory::Posting ShmTransport::waitPosted(int peer, uint64_t pairEpoch, const SharedMemory::Posting& mine,
                                              Deadline deadline) {
  const SharedPosting& shared = *peers_[peer]->segment.posting(rank(), pairEpoch);
  // A peer that sends this collective's messages instead of posting runs another algorithm:
  // look at the header of what it sent, held or still in the ring.
  auto checkMessages = [&] {
    const std::optional<CallSignature> theirs = arrivedCall(peer, mine.tag);
    if (theirs && !mine.call.agreesWith(*theirs)) {
      throw CommError(CommError::Kind::kMismatch, "rank " + std::to_string(peer) + " runs a different call",
                      CallMismatch{peer, mine.tag, mine.call, *theirs});
    }
  };
  waitUntil([&] { return shared.epoch.load(std::memory_order_acquire) >= pairEpoch; }, deadline,
            [&] {
              return "rank " + std::to_string(peer) + " to join shared-memory collective #" + std::to_string(pairEpoch) +
                     " of the two";
            },
            checkMessages);
  SharedMemory::Posting posting{shared.ownEpoch, shared.address,      shared.nbytes,      shared.tag,
                                shared.call,     shared.segmentFd,    shared.segmentBase, shared.segmentBytes};
  if (posting.segmentFd >= 0) {
    posting.mapped = mapPostedBuffer(peer, posting);
  }
  return posting;
}

char* ShmTransport::mapPostedBuffer(int rank, const SharedMemory::Posting& posting) {
  Peer& peer = *peers_[rank];
  const auto fail = [rank](const std::string& problem) {
    throw CommError(CommError::Kind::kPeer, "rank " + std::to_string(rank) + " " + problem);
  };
  std::string problem =
      SharedTensorArena::claimProblem(posting.address, posting.nbytes, posting.segmentBase, posting.segmentBytes);
  if (!problem.empty()) {
    fail(problem);
  }
  auto known = peer.tensorSegments.find(posting.segmentFd);
  if (known == peer.tensorSegments.end()) {
    const std::string path = "/proc/" + std::to_string(peer.pid) + "/fd/" + std::to_string(posting.segmentFd);
    char target[256];
    const ssize_t length = ::readlink(path.c_str(), target, sizeof(target));
    const int fd = length < 0 ? -1 : ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return nullptr; // the kernel will not let this process open it: copy through the kernel instead
    }
    struct stat st {};
    const uint64_t fileBytes = ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    problem = SharedTensorArena::fileProblem(std::string(target, static_cast<size_t>(length)), fileBytes,
                                             posting.segmentBytes);
    void* at = MAP_FAILED;
    if (problem.empty()) {
      at = ::mmap(nullptr, posting.segmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    ::close(fd);
    if (!problem.empty()) {
      fail(problem);
    }
    if (at == MAP_FAILED) {
      return nullptr;
    }
    ::madvise(at, posting.segmentBytes, MADV_HUGEPAGE); // as its owner asked (SharedTensorArena)
    known = peer.tensorSegments
                .emplace(posting.segmentFd,
                         Peer::TensorSegment{static_cast<char*>(at), posting.segmentBase, posting.segmentBytes})
                .first;
  }
  const Peer::TensorSegment& segment = known->second;
  if (segment.base != posting.segmentBase || segment.bytes != posting.segmentBytes) {
    fail("named its shared tensor segment at fd " + std::to_string(posting.segmentFd) +
         " with another place or size than before");
  }
  return segment.local + (posting.address - segment.base);
}

void ShmTransport::readPeer(int peer, uint64_t address, void* dst, size_t nbytes) {
  throwIfAborted();
  guardedCrossCopy(peers_[peer]->segment.control(), peers_[peer]->pid, peer, static_cast<char*>(dst), address, nbytes,
                   true);
}

void ShmTransport::writePeer(int peer, uint64_t address, const void* src, size_t nbytes) {
  throwIfAborted();
  guardedCrossCopy(peers_[peer]->segment.control(), peers_[peer]->pid, peer,
                   const_cast<char*>(static_cast<const char*>(src)), address, nbytes, false);
}

void ShmTransport::useMapped(int peer, const std::function<void()>& use) {
  throwIfAborted();
  guardedPeerAccess(peers_[peer]->segment.control(), peer, "use", [&] {
    use();
    return true;
  });
}

void ShmTransport::throwIfAborted() {
  if (aborted_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    throw CommError(CommError::Kind::kAborted, abortReason());
  }
}

void ShmTransport::signalDelivered(int peer) {
  peers_[peer]->segment.deliveries(rank())->count.fetch_add(1, std::memory_order_release);
  ring(peer);
}

void ShmTransport::waitDeliveries(const std::vector<int>& peers, Deadline deadline) {
  // A peer delivers for a later collective only after this rank has posted in it, which it does
  // after this wait: the counts never run ahead of what this rank waits for.
  for (int peer : peers) {
    ++deliveriesAwaited_[peer];
  }
  const auto behind = [&](int peer) {
    return self_->deliveries(peer)->count.load(std::memory_order_acquire) < deliveriesAwaited_[peer];
  };
  waitUntil([&] { return std::none_of(peers.begin(), peers.end(), behind); }, deadline,
            [&] {
              std::string who;
              for (int peer : peers) {
                if (behind(peer)) {
                  who += (who.empty() ? "rank " : ", ") + std::to_string(peer);
                }
              }
              return who + " to finish with this rank's buffer in a shared-memory collective";
            },
            nullptr);
}

} // namespace torus
