#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <cstring>
#include <sstream>
#include <thread>

#include "transport/shm/peer_memory.h"
#include "transport/shm/ring_link.h"
#include "transport/shm/shared_tensor_arena.h"
#include "transport/shm/shm_segment.h"

namespace torus {

using shm::ControlBlock;
using shm::crossCopy;
using shm::futexWait;
using shm::gaveUpText;
using shm::guardedCrossCopy;
using shm::guardedPeerAccess;
using shm::kSegmentMagic;
using shm::ringDoorbell;
using shm::SharedPosting;
using shm::systemError;

namespace {

// The longest a wait sleeps before it checks that its peers are alive.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
// How long a wait for peers spins (SpinWait: pausing or yielding, as TORUS_WAIT decides; a pause
// that finds nothing sleeps sooner) before it sleeps on the doorbell.
// Longer than kSpinBeforeSleep: against 50 and 500 µs, pause-spinning first and sleeping at once,
// 200 µs was as fast or faster at 2, 4 and 8 ranks on 2 cores (BENCHMARKS.md, "Waiting on
// shared memory").
constexpr auto kSpinBeforeSleepOnPeers = std::chrono::microseconds(200);

void storeCores(ControlBlock& control, const cpu_set_t& cores) {
  uint64_t words[shm::kCoreWords];
  static_assert(sizeof(words) == sizeof(cores));
  std::memcpy(words, &cores, sizeof(words));
  for (size_t i = 0; i < shm::kCoreWords; ++i) {
    control.cores[i].store(words[i], std::memory_order_relaxed);
  }
}

cpu_set_t loadCores(const ControlBlock& control) {
  uint64_t words[shm::kCoreWords];
  for (size_t i = 0; i < shm::kCoreWords; ++i) {
    words[i] = control.cores[i].load(std::memory_order_relaxed);
  }
  cpu_set_t cores;
  std::memcpy(&cores, words, sizeof(cores));
  return cores;
}

std::chrono::nanoseconds sleepFor(Deadline deadline) {
  auto left = deadline == Deadline::max() ? std::chrono::nanoseconds(kLivenessPeriod) : deadline - Clock::now();
  return std::max(std::chrono::nanoseconds(0),
                  std::min<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(kLivenessPeriod)));
}

} // namespace

struct ShmTransport::Peer {
  int rank = -1;
  int pid = 0;
  int pidfd = -1;
  Segment segment;
  // The peer reads single-copy messages from this process.
  bool readsSingleCopy = false;
  std::unique_ptr<RingLink> link;
  // The peer's SharedTensorArena segments mapped here, by the peer's fd; touched only by the
  // thread that runs collectives with the peer, as epochsWith_ is. An fd the peer closed may name
  // a later segment: the id tells them apart, and the file's identity tells whether the fd still
  // names the segment mapped.
  struct TensorSegment {
    char* local;
    uint64_t base; // in the peer's address space
    uint64_t bytes;
    uint64_t id; // the peer's
    dev_t device;
    ino_t inode;
  };
  std::map<int64_t, TensorSegment> tensorSegments;
  // The peer's releasedSegments when this process last dropped the mappings of its given-back
  // segments.
  uint64_t releasedSegmentsSeen = 0;

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
                           MessageOptions messages, WaitPolicy wait)
    : MessageTransport(rank, size, messages),
      spin_(wait),
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
    // 1 + the Farewell: 0 stays "still here".
    self_->control()->left.store(1 + static_cast<uint32_t>(currentDeparture()), std::memory_order_seq_cst);
    for (auto& peer : peers_) {
      if (peer) {
        ring(peer->rank);
      }
    }
  }
}

void ShmTransport::connectAll(Rendezvous& rendezvous, const std::vector<int>& members) {
  const size_t bytes = shm::segmentBytes(size());
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
  // Published before the segment's key: a peer reads it as soon as it maps the segment.
  storeCores(*self_->control(), SpinWait::usableCores());
  self_->control()->core.store(-1, std::memory_order_relaxed);
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
    peer->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, peer->pid, 0));
    // Can this process read the peer's memory directly? Probe with the peer's magic number.
    uint64_t probe = 0;
    readsAll = readsAll && crossCopy(peer->pid, reinterpret_cast<char*>(&probe), peerBase, sizeof(probe), true) &&
               probe == kSegmentMagic;
    peers_[r] = std::move(peer);
  }
  members_ = members;
  shareCores();
  coresDue_.store((Clock::now() + SpinWait::kCoresPeriod).time_since_epoch().count(), std::memory_order_relaxed);
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
    if (const uint32_t left = peer->segment.control()->left.load(std::memory_order_acquire); left != 0) {
      // Requests still owed by a rank that destroyed its group fail; the group lives on.
      peerLeft(peer->rank, departureText(peer->rank, departureOf(left)));
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
  // A piece of a read left to copy is work for now (workOutsideLock), not a reason to sleep.
  const auto toCopy = [this] {
    return std::any_of(peers_.begin(), peers_.end(),
                       [](const auto& peer) { return peer && peer->link && peer->link->reading().toCopy(); });
  };
  bool happened = tryAll() || aborted_.load() || toCopy();
  if (!happened) {
    lock.unlock();
    futexWait(&control->doorbell, seen, sleepFor(deadline));
    lock.lock();
    happened = control->doorbell.load(std::memory_order_seq_cst) != seen;
  }
  control->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return happened;
}

bool ShmTransport::workOutsideLock(std::unique_lock<std::mutex>& lock) {
  // At most one piece per peer's read, all copied in one release of the lock.
  std::vector<shm::SingleCopyRead*> claimed;
  for (auto& peer : peers_) {
    if (peer && peer->link && peer->link->reading().claim()) {
      claimed.push_back(&peer->link->reading());
    }
  }
  if (claimed.empty()) {
    return false;
  }
  lock.unlock();
  for (shm::SingleCopyRead* reading : claimed) {
    reading->copyClaimed();
  }
  lock.lock();
  return true;
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
  const Deadline drained = Clock::now() + shm::kCrossCopyDrain;
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

void ShmTransport::refreshCores() {
  const auto now = Clock::now();
  int64_t due = coresDue_.load(std::memory_order_relaxed);
  if (now.time_since_epoch().count() < due ||
      !coresDue_.compare_exchange_strong(due, (now + SpinWait::kCoresPeriod).time_since_epoch().count(),
                                         std::memory_order_relaxed)) {
    return;
  }
  shareCores();
}

void ShmTransport::shareCores() {
  const cpu_set_t mine = SpinWait::usableCores();
  storeCores(*self_->control(), mine);
  cpu_set_t cores = mine;
  for (int r : members_) {
    if (r != rank()) {
      const cpu_set_t theirs = loadCores(*peers_[r]->segment.control());
      CPU_OR(&cores, &cores, &theirs);
    }
  }
  spin_.setShare(static_cast<int>(members_.size()), CPU_COUNT(&cores), CPU_COUNT(&mine));
}

bool ShmTransport::peerSharesCore() {
  const int core = sched_getcpu(); // rseq: a load, no syscall
  self_->control()->core.store(core, std::memory_order_relaxed);
  if (core < 0) {
    return false;
  }
  for (int r : members_) {
    if (r != rank() && peers_[r]->segment.control()->core.load(std::memory_order_relaxed) == core) {
      return true;
    }
  }
  return false;
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
  shared.segmentId = posting.segmentId;
  shared.releasedSegments = posting.releasedSegments;
  shared.epoch.store(pairEpoch, std::memory_order_release);
  ring(peer);
}

template <typename Ready>
void ShmTransport::waitUntil(Ready ready, Deadline deadline, const std::function<std::string()>& waitingFor,
                             const std::function<void()>& whenIdle) {
  // What is there already costs no wait.
  if (ready()) {
    return;
  }
  refreshCores();
  {
    SpinWait::Wait wait(spin_, spin_.autoMayPause() && peerSharesCore());
    const auto spinUntil = Clock::now() + kSpinBeforeSleepOnPeers;
    while (Clock::now() < spinUntil) {
      if (ready()) {
        return;
      }
      if (!wait.relax()) {
        break;
      }
    }
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
                                shared.call,     shared.segmentFd,    shared.segmentBase, shared.segmentBytes,
                                shared.segmentId, shared.releasedSegments};
  if (posting.releasedSegments != peers_[peer]->releasedSegmentsSeen) {
    dropReleasedSegments(peer, posting.releasedSegments);
  }
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
  if (known != peer.tensorSegments.end() && known->second.id != posting.segmentId) {
    // The fd now names a later segment: the one mapped is gone from the peer.
    ::munmap(known->second.local, known->second.bytes);
    peer.tensorSegments.erase(known);
    known = peer.tensorSegments.end();
  }
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
                .emplace(posting.segmentFd, Peer::TensorSegment{static_cast<char*>(at), posting.segmentBase,
                                                               posting.segmentBytes, posting.segmentId, st.st_dev,
                                                               st.st_ino})
                .first;
  }
  const Peer::TensorSegment& segment = known->second;
  if (segment.base != posting.segmentBase || segment.bytes != posting.segmentBytes) {
    fail("named its shared tensor segment at fd " + std::to_string(posting.segmentFd) +
         " with another place or size than before");
  }
  return segment.local + (posting.address - segment.base);
}

void ShmTransport::dropReleasedSegments(int rank, uint64_t releasedSegments) {
  Peer& peer = *peers_[rank];
  for (auto it = peer.tensorSegments.begin(); it != peer.tensorSegments.end();) {
    const std::string path = "/proc/" + std::to_string(peer.pid) + "/fd/" + std::to_string(it->first);
    struct stat st {};
    const auto& segment = it->second;
    if (::stat(path.c_str(), &st) == 0 && st.st_dev == segment.device && st.st_ino == segment.inode) {
      ++it;
      continue;
    }
    ::munmap(segment.local, segment.bytes);
    it = peer.tensorSegments.erase(it);
  }
  peer.releasedSegmentsSeen = releasedSegments;
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
