#include "transport/polled_transport.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <sstream>
#include <thread>

namespace torus {

int millisecondsUntil(Clock::time_point when, int cap) {
  if (when == Clock::time_point::max()) {
    return cap;
  }
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(when - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left + 1, cap)));
}

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

// The process's one helper thread and the transports it watches. Never destroyed, and its
// thread detached: transports may outlive static destructors.
class ProgressHelper {
 public:
  static ProgressHelper& instance() {
    static ProgressHelper* helper = [] {
      ::pthread_atfork(&beforeFork, &inParent, &inChild);
      return new ProgressHelper();
    }();
    return *helper;
  }

  void join(PolledTransport* transport) {
    Entering entering(*this);
    std::lock_guard<std::mutex> lock(mutex_);
    transports_.insert(transport);
    if (!running_) {
      running_ = true;
      std::thread([this] { run(); }).detach();
    }
  }

  // Returns once the helper no longer touches `transport`.
  void leave(PolledTransport* transport) {
    Entering entering(*this);
    std::lock_guard<std::mutex> lock(mutex_);
    transports_.erase(transport);
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      bool drove = false;
      for (PolledTransport* transport : transports_) {
        drove |= transport->helpIfUnattended();
      }
      if (!drove) {
        // Unlocked while asleep, so that transports join and leave meanwhile.
        lock.unlock();
        std::this_thread::sleep_for(PolledTransport::kUnattended);
        lock.lock();
      } else if (entering_.load() > 0) {
        // A transport that always has work (a farewell its peer never reads) must not keep
        // others from joining or leaving: the lock is handed over before the next round.
        lock.unlock();
        while (entering_.load() > 0) {
          std::this_thread::yield();
        }
        lock.lock();
      }
    }
  }

  // A child forked while the helper held the lock would deadlock at its first join; it has no
  // helper thread, and its parent's transports are not its own.
  static void beforeFork() {
    instance().mutex_.lock();
  }
  static void inParent() {
    instance().mutex_.unlock();
  }
  static void inChild() {
    ProgressHelper& helper = instance();
    helper.transports_.clear();
    helper.running_ = false;
    helper.mutex_.unlock();
  }

  // Counts the threads waiting to join or leave while it is held.
  struct Entering {
    ProgressHelper& helper;
    explicit Entering(ProgressHelper& h) : helper(h) {
      ++helper.entering_;
    }
    ~Entering() {
      --helper.entering_;
    }
  };

  std::mutex mutex_;
  std::atomic<int> entering_{0};
  std::set<PolledTransport*> transports_;
  bool running_ = false;
};

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

bool PolledTransport::tryAllOnce(std::unique_lock<std::mutex>& lock) {
  ++progressRuns_;
  bool moved = tryAll();
  if (workOutsideLock(lock)) {
    // Another thread may have begun driving progress while the lock was released.
    if (progressing_) {
      wakeSleeper();
    } else {
      moved |= tryAll();
    }
  }
  return moved;
}

void PolledTransport::poke() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!progressing_ && tryAllOnce(lock)) {
    progressed_.notify_all();
  }
}

bool PolledTransport::test(const RequestPtr& request) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto& op = static_cast<const PendingOp&>(*request);
  if (!op.complete && !progressing_ && tryAllOnce(lock)) {
    progressed_.notify_all();
  }
  throwIfFailed(op);
  return op.complete;
}

void PolledTransport::joinHelper() {
  ProgressHelper::instance().join(this);
}

void PolledTransport::leaveHelper() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    leaving_ = true;
    if (helperDriving_) {
      wakeSleeper();
    }
  }
  ProgressHelper::instance().leave(this);
}

bool PolledTransport::helpIfUnattended() {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool unattended = !leaving_ && !progressing_ && waitersWanting_ == 0 && progressRuns_ == helperSeen_ &&
                          hasPending();
  helperSeen_ = progressRuns_;
  if (!unattended) {
    return false;
  }
  helperDriving_ = true;
  {
    Progressing progressing(*this);
    progress(lock, Clock::now() + kUnattended);
  }
  helperDriving_ = false;
  return true;
}

bool PolledTransport::spinBriefly(std::unique_lock<std::mutex>& lock) {
  const auto spinUntil = Clock::now() + kSpinBeforeSleep;
  do {
    if (tryAll() || workOutsideLock(lock)) {
      return true;
    }
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  } while (Clock::now() < spinUntil);
  return false;
}

} // namespace torus
