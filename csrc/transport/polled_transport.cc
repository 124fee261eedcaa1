#include "transport/polled_transport.h"

#include <algorithm>
#include <sstream>
#include <thread>

namespace torus {

namespace {

void throwIfFailed(const PendingOp& op) {
  if (!op.error.empty()) {
    throw CommError(op.errorKind, op.error, op.mismatch);
  }
}


} // namespace

std::string describePending(const std::vector<RequestPtr>& requests) {
  std::ostringstream out;
  const char* separator = "";
  for (const auto& request : requests) {
    const auto& op = static_cast<const PendingOp&>(*request);
    if (op.complete) {
      continue;
    }
    out << separator << (op.isSend ? "send of " : "receive of ") << op.nbytes << " bytes "
        << (op.isSend ? "to " : "from ");
    if (op.peerRank == kAnyPeer) {
      out << "any rank";
    } else {
      out << "rank " << op.peerRank;
    }
    separator = ", ";
  }
  return out.str();
}

bool PendingOp::accepts(int peer, const CallSignature& theirCall, size_t theirBytes) {
  if (!call.agreesWith(theirCall)) {
    fail(CommError::Kind::kMismatch, "rank " + std::to_string(peer) + " sent a message of a different call");
    mismatch = CallMismatch{peer, tag, call, theirCall};
    return false;
  }
  if (theirBytes != nbytes) {
    fail(CommError::Kind::kMismatch, "message from rank " + std::to_string(peer) + " has " +
                                         std::to_string(theirBytes) + " bytes where " + std::to_string(nbytes) +
                                         " were expected");
    return false;
  }
  return true;
}

void PolledTransport::wait(const std::vector<RequestPtr>& requests, Deadline deadline) {
  if (!waitFor(requests, deadline)) {
    std::lock_guard<std::mutex> lock(mutex_);
    throw CommError(CommError::Kind::kTimeout, "timed out waiting for " + describePending(requests));
  }
}

// Holds the driving role for one progress() call, and gives it up on every path: a throw out
// of progress() (bad_alloc, a failed syscall) must not leave every other waiter sleeping until
// its deadline.
struct PolledTransport::Progressing {
  PolledTransport& transport;
  explicit Progressing(PolledTransport& t) : transport(t) {
    transport.progressing_ = true;
  }
  ~Progressing() {
    transport.progressing_ = false;
    transport.progressed_.notify_all();
  }
};

PolledTransport::~PolledTransport() {
  stopHelper();
}

bool PolledTransport::waitFor(const std::vector<RequestPtr>& requests, Deadline until) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (bool first = true;; first = false) {
    bool allComplete = true;
    for (const auto& request : requests) {
      const auto& op = static_cast<const PendingOp&>(*request);
      throwIfFailed(op);
      allComplete = allComplete && op.complete;
    }
    if (allComplete) {
      return true;
    }
    if (!first && Clock::now() >= until) {
      return false;
    }
    if (!progressing_) {
      ++progressRuns_;
      Progressing progressing(*this);
      progress(lock, until);
    } else {
      const bool takeOver = helperDriving_;
      if (takeOver) {
        ++waitersWanting_;
        wakeSleeper();
      }
      progressed_.wait_until(lock, std::min(until, Clock::now() + std::chrono::seconds(1)));
      if (takeOver) {
        --waitersWanting_;
      }
    }
  }
}

void PolledTransport::poke() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!progressing_) {
    ++progressRuns_;
    if (tryAll()) {
      progressed_.notify_all();
    }
  }
}

bool PolledTransport::test(const RequestPtr& request) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto& op = static_cast<const PendingOp&>(*request);
  if (!op.complete && !progressing_) {
    ++progressRuns_;
    tryAll();
  }
  throwIfFailed(op);
  return op.complete;
}

void PolledTransport::startHelper() {
  helper_ = std::thread([this] { helperLoop(); });
}

void PolledTransport::stopHelper() {
  if (!helper_.joinable()) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (helperDriving_) {
      wakeSleeper();
    }
  }
  helperWake_.notify_all();
  helper_.join();
}

void PolledTransport::helperLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  uint64_t seen = progressRuns_;
  while (!stopping_) {
    helperWake_.wait_for(lock, kUnattended);
    const bool unattended = !stopping_ && !progressing_ && progressRuns_ == seen && hasPending();
    seen = progressRuns_;
    if (!unattended) {
      continue;
    }
    helperDriving_ = true;
    while (!stopping_ && !progressing_ && waitersWanting_ == 0 && hasPending()) {
      Progressing progressing(*this);
      progress(lock, Clock::now() + kUnattended);
    }
    helperDriving_ = false;
    seen = progressRuns_;
  }
}

bool PolledTransport::spinBriefly(std::unique_lock<std::mutex>& lock) {
  const auto spinUntil = Clock::now() + kSpinBeforeSleep;
  do {
    if (tryAll()) {
      return true;
    }
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  } while (Clock::now() < spinUntil);
  return false;
}

} // namespace torus
