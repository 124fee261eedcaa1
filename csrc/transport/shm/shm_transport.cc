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
#include <numeric>
#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

namespace torus {

namespace {

constexpr uint64_t kSegmentMagic = 0x746f7275732d7368; // "torus-sh"
constexpr size_t kLine = 64;
// The longest a wait sleeps before it checks that its peers are alive.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);

enum MessageKind : uint32_t { kEager = 1, kSingleCopy = 2, kAck = 3 };

// One ring entry's header; eager payloads follow it, padded to whole lines.
struct alignas(kLine) MessageHeader {
  uint64_t tag;
  uint64_t nbytes;
  uint64_t address; // kSingleCopy: where the payload is in the sender's memory
  uint64_t sequence; // kSingleCopy and kAck: which single-copy send this is
  CallSignature call;
  uint32_t kind;
};
static_assert(sizeof(MessageHeader) == kLine, "ring entries stay line-aligned");

// One posting cell: what the segment's owner announced to one peer for their collective `epoch`.
struct alignas(kLine) SharedPosting {
  std::atomic<uint64_t> epoch; // counted per pair of ranks
  uint64_t ownEpoch; // the owner's own count: names its slot
  uint64_t address;
  uint64_t nbytes;
  uint64_t tag;
  CallSignature call;
};

constexpr size_t kFaultTextBytes = 1024;

struct ControlBlock {
  uint64_t magic;
  int32_t pid;
  // Set when the owner destroys its transport: its exit afterwards is a departure, not a death.
  std::atomic<uint32_t> left;
  // Set when the owner gives up on the group (abort()); faultText says why.
  std::atomic<uint32_t> faulted;
  char faultText[kFaultTextBytes];
  alignas(kLine) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleepers;
  // Peers that finished reading each one-shot slot, ever.
  alignas(kLine) std::atomic<uint64_t> slotReleases[2];
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

struct ShmTransport::Op : PendingOp {
  MessageHeader header{};
};

struct ShmTransport::Peer {
  int rank = -1;
  int pid = 0;
  int pidfd = -1;
  Segment segment;
  // The peer reads single-copy messages from this process.
  bool readsSingleCopy = false;
  std::string failure;

  // Sending: entries go into the ring this rank owns in the peer's segment, in order; the head
  // entry may be partly written (an eager payload larger than the free space).
  std::deque<std::shared_ptr<Op>> sends;
  size_t headWritten = 0; // of the head entry, header included
  uint64_t sendPos = 0;
  uint64_t nextSequence = 0;
  std::map<uint64_t, std::shared_ptr<Op>> awaitingAck;

  // Receiving from the peer's ring in this rank's segment.
  uint64_t recvPos = 0;
  bool inPayload = false;
  MessageHeader header{};
  size_t payloadRead = 0; // padding included
  std::shared_ptr<Op> target;
  bool discard = false;
  std::vector<char> holding;

  // Messages nobody asked for yet: eager payloads, or single-copy descriptors (header only).
  struct Held {
    MessageHeader header;
    std::vector<char> payload;
  };
  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> posted;
  std::map<uint64_t, std::deque<Held>> arrived;

  // The last collective this rank sent the peer a probe about.
  uint64_t probedTag = UINT64_MAX;

  SharedRing* outRing = nullptr; // in the peer's segment
  SharedRing* inRing = nullptr; // in this rank's segment

  ~Peer() {
    if (pidfd >= 0) {
      ::close(pidfd);
    }
  }
};

ShmTransport::ShmTransport(int rank, int size, Rendezvous& rendezvous, std::vector<int> members)
    : rank_(rank),
      size_(size),
      self_(std::make_unique<Segment>()),
      peers_(static_cast<size_t>(size)),
      epochsWith_(static_cast<size_t>(size), 0),
      deliveriesAwaited_(static_cast<size_t>(size), 0) {
  if (members.empty()) {
    members.resize(static_cast<size_t>(size));
    std::iota(members.begin(), members.end(), 0);
  }
  connectAll(rendezvous, members);
}

ShmTransport::~ShmTransport() {
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
  const size_t bytes = segmentBytes(size_);
  int fd = ::memfd_create(("torus-rank" + std::to_string(rank_)).c_str(), MFD_CLOEXEC);
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
  self_->groupSize = size_;
  self_->control()->magic = kSegmentMagic;
  self_->control()->pid = static_cast<int32_t>(::getpid());
  std::ostringstream mine;
  mine << ::getpid() << ' ' << fd << ' ' << bytes << ' ' << reinterpret_cast<uintptr_t>(base);
  rendezvous.set("shm/" + std::to_string(rank_), mine.str());

  bool readsAll = true;
  for (int r : members) {
    if (r == rank_) {
      continue;
    }
    auto peer = std::make_unique<Peer>();
    peer->rank = r;
    std::istringstream theirs(rendezvous.get("shm/" + std::to_string(r)));
    int peerFd = -1;
    size_t peerBytes = 0;
    uintptr_t peerBase = 0;
    theirs >> peer->pid >> peerFd >> peerBytes >> peerBase;
    const std::string path = "/proc/" + std::to_string(peer->pid) + "/fd/" + std::to_string(peerFd);
    int mapped = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (mapped < 0) {
      throw CommError(CommError::Kind::kPeer,
                      systemError("torus: rank " + std::to_string(rank_) + " cannot open rank " + std::to_string(r) +
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
    peer->segment.groupSize = size_;
    if (peer->segment.control()->magic != kSegmentMagic) {
      throw CommError(CommError::Kind::kPeer, "torus: rank " + std::to_string(r) + "'s shared memory is not a torus "
                                              "segment");
    }
    peer->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, peer->pid, 0));
    peer->outRing = peer->segment.ring(rank_);
    peer->inRing = self_->ring(r);
    // Can this process read the peer's memory directly? Probe with the peer's magic number.
    uint64_t probe = 0;
    readsAll = readsAll && crossCopy(peer->pid, reinterpret_cast<char*>(&probe), peerBase, sizeof(probe), true) &&
               probe == kSegmentMagic;
    peers_[r] = std::move(peer);
  }
  // Every rank has mapped every segment once all have published this key, so the fds (the only
  // handles left besides the mappings) can close.
  rendezvous.set("shm/ready/" + std::to_string(rank_), readsAll ? "1" : "0");
  singleCopy_ = readsAll;
  for (auto& peer : peers_) {
    if (peer) {
      peer->readsSingleCopy = rendezvous.get("shm/ready/" + std::to_string(peer->rank)) == "1";
      singleCopy_ = singleCopy_ && peer->readsSingleCopy;
    }
  }
}

RequestPtr ShmTransport::isend(int peer, uint64_t tag, const CallSignature& call, const void* buf, size_t nbytes) {
  if (peer < 0 || peer >= size_ || peer == rank_ || !peers_[peer]) {
    throw std::invalid_argument("torus: invalid send peer " + std::to_string(peer));
  }
  auto op = makeOp<Op>(this, true, peer, tag, call, buf, nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = *peers_[peer];
  const bool singleCopy = p.readsSingleCopy && nbytes > kSingleCopyBytes;
  op->header = MessageHeader{tag, nbytes, singleCopy ? reinterpret_cast<uint64_t>(buf) : 0,
                             singleCopy ? ++p.nextSequence : 0, call, singleCopy ? kSingleCopy : kEager};
  if (!abortReason_.empty()) {
    op->fail(CommError::Kind::kAborted, abortReason_);
  } else if (!p.failure.empty()) {
    op->fail(CommError::Kind::kPeer, p.failure);
  } else {
    p.sends.push_back(op);
    if (p.sends.size() == 1) {
      trySend(p);
    }
  }
  return op;
}

void ShmTransport::readSingleCopy(Peer& peer, Op& op, uint64_t address) {
  if (!crossCopy(peer.pid, op.buf, address, op.nbytes, true)) {
    op.fail(CommError::Kind::kPeer, systemError("cannot read rank " + std::to_string(peer.rank) + "'s memory"));
    return;
  }
  op.complete = true;
}

void ShmTransport::queueAck(Peer& peer, uint64_t sequence) {
  auto ack = std::make_shared<Op>();
  ack->isSend = true;
  ack->peerRank = peer.rank;
  ack->header = MessageHeader{0, 0, 0, sequence, {}, kAck};
  peer.sends.push_back(ack);
  if (peer.sends.size() == 1) {
    trySend(peer);
  }
}

RequestPtr ShmTransport::irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) {
  if (peer != kAnyPeer && (peer < 0 || peer >= size_ || peer == rank_ || !peers_[peer])) {
    throw std::invalid_argument("torus: invalid receive peer " + std::to_string(peer));
  }
  auto op = makeOp<Op>(this, false, peer, tag, call, buf, nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abortReason_.empty()) {
    op->fail(CommError::Kind::kAborted, abortReason_);
    return op;
  }
  postReceive(op, peer, tag, peers_, anyPeerReceives_, [&](Peer& p, Op& receive) {
    auto held = popOldest(p.arrived, tag);
    if (!held) {
      return false;
    }
    receive.peerRank = p.rank;
    if (receive.accepts(p.rank, held->header.call, held->header.nbytes)) {
      if (held->header.kind == kSingleCopy) {
        readSingleCopy(p, receive, held->header.address);
      } else {
        std::memcpy(buf, held->payload.data(), nbytes);
        receive.complete = true;
      }
    }
    if (held->header.kind == kSingleCopy) {
      queueAck(p, held->header.sequence);
    }
    return true;
  });
  return op;
}

std::shared_ptr<ShmTransport::Op> ShmTransport::matchPosted(Peer& peer, uint64_t tag) {
  return matchPostedReceive(peer.posted, anyPeerReceives_, tag, peer.rank);
}

bool ShmTransport::trySend(Peer& peer) {
  bool completed = false;
  SharedRing& ring = *peer.outRing;
  const uint64_t start = peer.sendPos;
  while (!peer.sends.empty() && peer.failure.empty()) {
    Op& op = *peer.sends.front();
    uint64_t free = kRingBytes - (peer.sendPos - ring.tail.load(std::memory_order_acquire));
    if (free < kLine) {
      // Ask the consumer to ring us when it frees space, then look again in case it just did.
      ring.producerWaiting.store(1, std::memory_order_seq_cst);
      free = kRingBytes - (peer.sendPos - ring.tail.load(std::memory_order_seq_cst));
      if (free < kLine) {
        break;
      }
    }
    if (peer.headWritten == 0) {
      copyIn(ring.data, peer.sendPos, reinterpret_cast<const char*>(&op.header), kLine);
      peer.sendPos += kLine;
      peer.headWritten = kLine;
      free -= kLine;
      if (op.header.kind != kEager) {
        if (op.header.kind == kSingleCopy) {
          peer.awaitingAck[op.header.sequence] = peer.sends.front();
        } else {
          completed = true;
        }
        op.complete = op.header.kind == kAck;
        peer.sends.pop_front();
        peer.headWritten = 0;
        continue;
      }
    }
    const size_t padded = roundUp(op.nbytes, kLine);
    const size_t written = peer.headWritten - kLine;
    const size_t n = std::min<size_t>(free, padded - written);
    if (written < op.nbytes) {
      copyIn(ring.data, peer.sendPos, op.buf + written, std::min(n, op.nbytes - written));
    }
    peer.sendPos += n;
    peer.headWritten += n;
    if (written + n == padded) {
      op.complete = true;
      completed = true;
      peer.sends.pop_front();
      peer.headWritten = 0;
    } else {
      ring.producerWaiting.store(1, std::memory_order_seq_cst);
      if (kRingBytes - (peer.sendPos - ring.tail.load(std::memory_order_seq_cst)) == 0) {
        break;
      }
    }
  }
  if (peer.sendPos != start) {
    ring.head.store(peer.sendPos, std::memory_order_release);
    this->ring(peer.rank);
  }
  return completed;
}

bool ShmTransport::tryRecv(Peer& peer) {
  bool completed = false;
  SharedRing& ring = *peer.inRing;
  const uint64_t start = peer.recvPos;
  uint64_t head = ring.head.load(std::memory_order_acquire);
  while (peer.failure.empty()) {
    uint64_t available = head - peer.recvPos;
    if (!peer.inPayload) {
      if (available < kLine) {
        break;
      }
      MessageHeader header;
      copyOut(reinterpret_cast<char*>(&header), ring.data, peer.recvPos, kLine);
      peer.recvPos += kLine;
      if (header.kind == kAck) {
        auto it = peer.awaitingAck.find(header.sequence);
        if (it != peer.awaitingAck.end()) {
          it->second->complete = true;
          peer.awaitingAck.erase(it);
          completed = true;
        }
        continue;
      }
      auto target = header.tag == kProbeTag ? nullptr : matchPosted(peer, header.tag);
      if (target && !target->accepts(peer.rank, header.call, header.nbytes)) {
        completed = true;
        if (header.kind == kSingleCopy) {
          queueAck(peer, header.sequence);
          continue;
        }
        target.reset();
        peer.discard = true;
      }
      if (header.kind == kSingleCopy) {
        if (target) {
          readSingleCopy(peer, *target, header.address);
          queueAck(peer, header.sequence);
          completed = true;
        } else {
          peer.arrived[header.tag].push_back({header, {}});
        }
        continue;
      }
      peer.header = header;
      peer.inPayload = true;
      peer.payloadRead = 0;
      peer.target = std::move(target);
      if (!peer.target && !peer.discard) {
        peer.holding.resize(header.nbytes);
      }
      available = head - peer.recvPos;
    }
    const size_t padded = roundUp(peer.header.nbytes, kLine);
    const size_t n = std::min<size_t>(available, padded - peer.payloadRead);
    if (peer.payloadRead < peer.header.nbytes && !peer.discard) {
      char* base = peer.target ? peer.target->buf : peer.holding.data();
      copyOut(base + peer.payloadRead, ring.data, peer.recvPos,
              std::min(n, peer.header.nbytes - peer.payloadRead));
    }
    peer.recvPos += n;
    peer.payloadRead += n;
    if (peer.payloadRead < padded) {
      break;
    }
    peer.inPayload = false;
    if (peer.target) {
      peer.target->complete = true;
      peer.target.reset();
    } else if (peer.header.tag == kProbeTag) {
      uint64_t probed = 0;
      std::memcpy(&probed, peer.holding.data(), std::min(peer.holding.size(), sizeof(probed)));
      failDisagreeing(peer.rank, probed, peer.header.call);
      peer.holding = {};
    } else if (!peer.discard) {
      auto late = matchPosted(peer, peer.header.tag);
      if (late) {
        if (late->accepts(peer.rank, peer.header.call, peer.header.nbytes)) {
          std::memcpy(late->buf, peer.holding.data(), peer.holding.size());
          late->complete = true;
        }
      } else {
        peer.arrived[peer.header.tag].push_back({peer.header, std::move(peer.holding)});
      }
      peer.holding = {};
    }
    peer.discard = false;
    completed = true;
  }
  if (peer.recvPos != start) {
    ring.tail.store(peer.recvPos, std::memory_order_seq_cst);
    if (ring.producerWaiting.exchange(0, std::memory_order_seq_cst) != 0) {
      this->ring(peer.rank);
    }
  }
  return completed;
}

void ShmTransport::ring(int rank) {
  ControlBlock* control = rank == rank_ ? self_->control() : peers_[rank]->segment.control();
  control->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (control->sleepers.load(std::memory_order_seq_cst) > 0) {
    futexWake(&control->doorbell);
  }
}

void ShmTransport::failPending(Peer& peer, CommError::Kind kind, const std::string& why) {
  for (auto& op : peer.sends) {
    op->fail(kind, why);
  }
  peer.sends.clear();
  peer.headWritten = 0;
  for (auto& entry : peer.awaitingAck) {
    entry.second->fail(kind, why);
  }
  peer.awaitingAck.clear();
  failQueued(peer.posted, kind, why);
  if (peer.target) {
    peer.target->fail(kind, why);
    peer.target.reset();
    peer.discard = true;
  }
}

void ShmTransport::failPeer(Peer& peer, const std::string& why) {
  if (!peer.failure.empty()) {
    return;
  }
  failEveryPeer(peers_, anyPeerReceives_, why, [&](Peer& other) { failPending(other, CommError::Kind::kPeer, why); });
  progressed_.notify_all();
}

void ShmTransport::checkLiveness() {
  for (auto& peer : peers_) {
    if (!peer || !peer->failure.empty()) {
      continue;
    }
    if (peer->segment.control()->left.load(std::memory_order_acquire) != 0) {
      // Requests still owed by a rank that destroyed its group fail; the group lives on.
      peer->failure = "rank " + std::to_string(peer->rank) + " left the group (destroyed its process group)";
      failPending(*peer, CommError::Kind::kPeer, peer->failure);
      continue;
    }
    pollfd pfd{peer->pidfd, POLLIN, 0};
    if (peer->pidfd >= 0 && ::poll(&pfd, 1, 0) > 0) {
      failPeer(*peer, "rank " + std::to_string(peer->rank) + " (pid " + std::to_string(peer->pid) +
                          ") exited: the process ended or was killed");
    }
  }
}

std::optional<Transport::StrayMessage> ShmTransport::strayMessage(uint64_t upToTag) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& peer : peers_) {
    if (!peer) {
      continue;
    }
    if (!peer->arrived.empty() && peer->arrived.begin()->first <= upToTag) {
      return StrayMessage{peer->rank, peer->arrived.begin()->first, peer->arrived.begin()->second.front().header.call};
    }
    // Still in the ring: nobody has read it, as nobody expected it.
    if (!peer->inPayload && peer->inRing->head.load(std::memory_order_acquire) - peer->recvPos >= kLine) {
      MessageHeader header;
      copyOut(reinterpret_cast<char*>(&header), peer->inRing->data, peer->recvPos, kLine);
      if (header.kind != kAck && header.tag <= upToTag) {
        return StrayMessage{peer->rank, header.tag, header.call};
      }
    }
  }
  return std::nullopt;
}

bool ShmTransport::checkFaults() {
  bool failed = false;
  for (auto& peer : peers_) {
    if (peer && peer->failure.empty() && peer->segment.control()->faulted.load(std::memory_order_acquire) != 0) {
      const char* text = peer->segment.control()->faultText;
      failPeer(*peer, "rank " + std::to_string(peer->rank) + " gave up on the group: " +
                          std::string(text, ::strnlen(text, kFaultTextBytes)));
      failed = true;
    }
  }
  return failed;
}

bool ShmTransport::checkPostedCalls() {
  // A receive posted for a collective while another rank sent a message of that collective, or
  // announced a shared-memory collective of that sequence number, with a different call: the
  // ranks called different collectives, which no message between the two shows.
  bool failed = false;
  for (auto& peer : peers_) {
    if (!peer) {
      continue;
    }
    for (auto& [tag, held] : peer->arrived) {
      failed |= failDisagreeing(peer->rank, tag, held.front().header.call);
    }
    for (uint64_t parity : {0, 1}) {
      const SharedPosting& posting = *peer->segment.posting(rank_, parity);
      if (posting.epoch.load(std::memory_order_acquire) != 0) {
        failed |= failDisagreeing(peer->rank, posting.tag, posting.call);
      }
    }
  }
  return failed;
}

bool ShmTransport::failDisagreeing(int sender, uint64_t tag, const CallSignature& call) {
  bool failed = false;
  for (auto& peer : peers_) {
    if (peer) {
      failed |= failDisagreeingIn(peer->posted, sender, tag, call);
    }
  }
  return failDisagreeingIn(anyPeerReceives_, sender, tag, call) || failed;
}

void ShmTransport::probeWaits() {
  for (auto& peer : peers_) {
    if (!peer || !peer->failure.empty()) {
      continue;
    }
    for (auto& probe : probesFor<Op>(*peer)) {
      probe->header = MessageHeader{kProbeTag, sizeof(probe->probedTag), 0, 0, probe->call, kEager};
      peer->sends.push_back(probe);
      if (peer->sends.size() == 1) {
        trySend(*peer);
      }
    }
  }
}

bool ShmTransport::tryAll() {
  bool moved = checkFaults();
  for (auto& peer : peers_) {
    if (peer && peer->failure.empty()) {
      moved |= tryRecv(*peer);
      moved |= trySend(*peer);
    }
  }
  return moved;
}

void ShmTransport::progress(std::unique_lock<std::mutex>& lock, Deadline deadline) {
  if (spinBriefly(lock)) {
    return;
  }
  ControlBlock* control = self_->control();
  const uint32_t seen = control->doorbell.load(std::memory_order_seq_cst);
  control->sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (!tryAll() && !aborted_.load()) {
    lock.unlock();
    futexWait(&control->doorbell, seen, sleepFor(deadline));
    lock.lock();
    if (control->doorbell.load(std::memory_order_seq_cst) == seen) {
      checkLiveness();
      checkPostedCalls();
      probeWaits();
    }
  }
  control->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void ShmTransport::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!abortReason_.empty()) {
    return;
  }
  abortReason_ = why;
  aborted_.store(true);
  ControlBlock* control = self_->control();
  const size_t n = std::min(why.size(), kFaultTextBytes - 1);
  std::memcpy(control->faultText, why.data(), n);
  control->faultText[n] = '\0';
  control->faulted.store(1, std::memory_order_release);
  for (auto& peer : peers_) {
    if (peer) {
      failPending(*peer, CommError::Kind::kAborted, why);
      peer->failure = why;
      ring(peer->rank);
    }
  }
  failQueued(anyPeerReceives_, CommError::Kind::kAborted, why);
  ring(rank_);
  progressed_.notify_all();
}

// ---- Collective support ----

bool ShmTransport::connects(int rank) const {
  return rank == rank_ || (rank >= 0 && rank < size_ && peers_[rank] != nullptr);
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
  return rank == rank_ ? self_->slot(ownEpoch) : peers_[rank]->segment.slot(ownEpoch);
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
  shared.epoch.store(pairEpoch, std::memory_order_release);
  ring(peer);
}

template <typename Ready>
void ShmTransport::waitUntil(Ready ready, Deadline deadline, const std::function<std::string()>& waitingFor,
                             const std::function<void()>& whenIdle) {
  const auto spinUntil = Clock::now() + kSpinBeforeSleep;
  while (Clock::now() < spinUntil) {
    if (ready()) {
      return;
    }
    std::this_thread::yield();
  }
  ControlBlock* control = self_->control();
  for (;;) {
    if (ready()) {
      return;
    }
    if (aborted_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      throw CommError(CommError::Kind::kAborted, abortReason_);
    }
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
    checkFaults();
    if (control->doorbell.load(std::memory_order_seq_cst) == seen) {
      // Nothing happened for a while: is everyone we may be waiting for still alive, and still
      // in the same collective?
      checkLiveness();
      if (whenIdle) {
        whenIdle();
      }
    }
    for (auto& peer : peers_) {
      if (peer && !peer->failure.empty()) {
        throw CommError(CommError::Kind::kPeer, peer->failure);
      }
    }
  }
}

SharedMemory::Posting ShmTransport::waitPosted(int peer, uint64_t pairEpoch, const SharedMemory::Posting& mine,
                                              Deadline deadline) {
  const SharedPosting& shared = *peers_[peer]->segment.posting(rank_, pairEpoch);
  // A peer that sends this collective's messages instead of posting runs another algorithm:
  // look at the header of what it sent, held or still in the ring.
  auto checkMessages = [&] {
    Peer& p = *peers_[peer];
    std::optional<CallSignature> theirs;
    auto held = p.arrived.find(mine.tag);
    if (held != p.arrived.end()) {
      theirs = held->second.front().header.call;
    } else if (!p.inPayload && p.inRing->head.load(std::memory_order_acquire) - p.recvPos >= kLine) {
      MessageHeader header;
      copyOut(reinterpret_cast<char*>(&header), p.inRing->data, p.recvPos, kLine);
      if (header.kind != kAck && header.tag == mine.tag) {
        theirs = header.call;
      }
    }
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
  return SharedMemory::Posting{shared.ownEpoch, shared.address, shared.nbytes, shared.tag, shared.call};
}

void ShmTransport::readPeer(int peer, uint64_t address, void* dst, size_t nbytes) {
  if (!crossCopy(peers_[peer]->pid, static_cast<char*>(dst), address, nbytes, true)) {
    throw CommError(CommError::Kind::kPeer, systemError("cannot read rank " + std::to_string(peer) + "'s memory"));
  }
}

void ShmTransport::writePeer(int peer, uint64_t address, const void* src, size_t nbytes) {
  if (!crossCopy(peers_[peer]->pid, const_cast<char*>(static_cast<const char*>(src)), address, nbytes, false)) {
    throw CommError(CommError::Kind::kPeer, systemError("cannot write rank " + std::to_string(peer) + "'s memory"));
  }
}

void ShmTransport::signalDelivered(int peer) {
  peers_[peer]->segment.deliveries(rank_)->count.fetch_add(1, std::memory_order_release);
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
