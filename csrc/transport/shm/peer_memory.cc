#include "transport/shm/peer_memory.h"

#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace torus {
namespace shm {

std::string systemError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

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

void guardedCrossCopy(ControlBlock* peer, int pid, int peerRank, char* local, uint64_t remote, size_t nbytes,
                      bool read) {
  guardedPeerAccess(peer, peerRank, read ? "read" : "write",
                    [&] { return crossCopy(pid, local, remote, nbytes, read); });
}

void SingleCopyRead::start(uint64_t address, char* dst, size_t n) {
  active_ = true;
  address_ = address;
  dst_ = dst;
  n_ = n;
  done_ = 0;
  failure_.clear();
}

bool SingleCopyRead::finished() {
  if (!active_) {
    return true;
  }
  if (copying_.load(std::memory_order_acquire)) {
    return false;
  }
  if (!failure_.empty()) {
    active_ = false;
    throw CommError(CommError::Kind::kPeer, failure_);
  }
  if (done_ < n_) {
    return false;
  }
  active_ = false;
  return true;
}

void SingleCopyRead::abandon() {
  // A piece is at most kPieceBytes, and its copier takes no lock until it has ended.
  while (copying_.load(std::memory_order_acquire)) {
    std::this_thread::yield();
  }
  active_ = false;
}

bool SingleCopyRead::claim() {
  if (!toCopy()) {
    return false;
  }
  copying_.store(true, std::memory_order_relaxed);
  return true;
}

bool SingleCopyRead::toCopy() const {
  // copying_ first: while it is set, the copier writes done_ and failure_.
  return !copying_.load(std::memory_order_acquire) && active_ && done_ < n_ && failure_.empty();
}

void SingleCopyRead::copyClaimed() {
  struct Ending {
    std::atomic<bool>& copying;
    ~Ending() {
      copying.store(false, std::memory_order_release);
    }
  } ending{copying_};
  const size_t piece = std::min(kPieceBytes, n_ - done_);
  const auto leftText = [this](uint32_t left) {
    return departureText(peerRank_, departureOf(left)) + " while this rank read its message";
  };
  try {
    if (const uint32_t left = peer_->left.load(std::memory_order_seq_cst); left != 0) {
      failure_ = leftText(left);
    } else {
      guardedCrossCopy(peer_, pid_, peerRank_, dst_ + done_, address_ + done_, piece, true);
      if (const uint32_t after = peer_->left.load(std::memory_order_seq_cst); after != 0) {
        failure_ = leftText(after);
      } else {
        done_ += piece;
      }
    }
  } catch (const CommError& e) {
    failure_ = e.what();
  }
}

} // namespace shm
} // namespace torus
