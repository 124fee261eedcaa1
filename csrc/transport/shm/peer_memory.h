// Copies between this process's memory and a peer's (process_vm_readv / process_vm_writev,
// "CMA"), guarded against the peer giving up meanwhile; and the single-copy receive, which reads
// a message from the sender's buffer in bounded pieces with the transport's lock released.
//
// The guard: a copier counts itself in the peer's control block (crossCopiers) for the length of
// one copy, and looks at the peer's `faulted` flag before and after it. A peer that gives up
// sets `faulted`, then waits for the count to drop (kCrossCopyDrain at most) before abort()
// returns and its buffers may be freed or reused. So a copy that saw no fault after it ended read
// memory the peer had not let go of; one that saw it fails, naming the peer.
//
// The single-copy receive (SingleCopyRead, one per RingLink): the message layer starts it and
// asks whether it finished on each pass of its progress loop (Link::startRead/continueRead, with
// the lock held); the copying happens in ShmTransport::workOutsideLock, by whichever thread is
// making progress, kPieceBytes at a time with the lock released, so that one large message
// neither holds the lock for the whole copy nor keeps abort() waiting past a piece; each piece is
// guarded as above and also fails when the sender left (destroyed its group). A failed piece
// fails the receive; the message layer then tells the sender its send was not read.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>

#include "transport/shm/shm_segment.h"

namespace torus {
namespace shm {

// How long abort() waits for peers' copies from or into this rank's memory to finish.
constexpr auto kCrossCopyDrain = std::chrono::seconds(2);

std::string systemError(const std::string& what);

// Moves nbytes between this process's `local` and another process's `remote` address, by
// process_vm_readv (read) or process_vm_writev; false, with errno set, when the kernel refuses.
bool crossCopy(int pid, char* local, uint64_t remote, size_t nbytes, bool read);

// Runs access() on the memory of the peer whose control block is `peer`, unless the peer has given
// up on the group (see above). Throws CommError naming `peerRank` when the peer gave up before the
// access ended, or when access() returns false (the kernel refused a copy; errno says why, `what`
// says what was refused).
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
    if (!gaveUp) {
      done = access();
      err = errno;
      gaveUp = peer->faulted.load(std::memory_order_seq_cst) != 0;
    }
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
                      bool read);

// One message at a time read from a peer's memory, a piece at a time (see above). All but
// copyClaimed run with the transport's lock held.
class SingleCopyRead {
 public:
  // The most one piece copies: about a millisecond of the lock released, and of abort()'s wait.
  static constexpr size_t kPieceBytes = size_t{4} << 20;

  SingleCopyRead(ControlBlock* peer, int pid, int peerRank) : peer_(peer), pid_(pid), peerRank_(peerRank) {}

  // Begins reading n bytes at the peer's `address` into dst; nothing is copied yet.
  void start(uint64_t address, char* dst, size_t n);
  // True once all n bytes are in dst. Throws CommError (naming the peer) once a piece failed.
  bool finished();
  // Gives the read up: waits for a piece under way to end; nothing lands in dst afterwards.
  void abandon();
  // Claims the next piece for copyClaimed: false when there is none to copy now (no read, every
  // byte copied, a piece under way, or one failed).
  bool claim();
  // A piece waits to be claimed.
  bool toCopy() const;
  // With the lock released, after claim() returned true: copies the claimed piece.
  void copyClaimed();

 private:
  ControlBlock* const peer_;
  const int pid_;
  const int peerRank_;
  bool active_ = false;
  uint64_t address_ = 0;
  char* dst_ = nullptr;
  size_t n_ = 0;
  // Written by copyClaimed while copying_, read under the lock once it is not.
  size_t done_ = 0;
  std::string failure_;
  std::atomic<bool> copying_{false};
};

} // namespace shm
} // namespace torus
