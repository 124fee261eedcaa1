#include "transport/turned_away_log.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace torus {

using Clock = std::chrono::steady_clock;

struct TurnedAwayLog::Door {
  int rank = 0;
  std::string what;
  int total = 0; // turned away so far
  int oneByOneLeft = kOneByOne;
  Clock::time_point latest; // when the latest was turned away
  // Turned away since `since` and not reported yet: the next summary's.
  int unreported = 0;
  Clock::time_point since;
  std::string latestFrom;
  std::string latestWhy;
};

namespace {

std::string oneLine(const TurnedAwayLog::Door& door, const std::string& from, const std::string& why) {
  return "[torus rank " + std::to_string(door.rank) + "] warning: turned away a " + door.what + " from " + from +
         ": it did not prove it belongs to the group (" + why + "); " + std::to_string(door.total) +
         " turned away so far\n";
}

std::string summary(const TurnedAwayLog::Door& door, Clock::time_point now) {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f",
                std::chrono::duration<double>(now - door.since).count());
  return "[torus rank " + std::to_string(door.rank) + "] warning: turned away " + std::to_string(door.unreported) +
         " more " + door.what + "s in the last " + seconds + " s, the latest from " + door.latestFrom +
         " (" + door.latestWhy + "); " + std::to_string(door.total) + " turned away so far (the first " +
         std::to_string(TurnedAwayLog::kOneByOne) + " of a burst are reported one by one)\n";
}

// Whole, or until stderr fails: a line is never cut by an interrupted write.
void writeToStderr(const std::string& line) {
  for (size_t done = 0; done < line.size();) {
    const ssize_t wrote = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (wrote > 0) {
      done += static_cast<size_t>(wrote);
    } else if (wrote == 0 || errno != EINTR) {
      return;
    }
  }
}

// The process's writer: its queue, the doors with a summary due, and the thread that writes them.
// Never destroyed, its thread detached: it may be blocked in a write at exit.
class Writer {
 public:
  static Writer& instance() {
    static Writer* writer = [] {
      ::pthread_atfork(&beforeFork, &inParent, &inChild);
      return new Writer();
    }();
    return *writer;
  }

  void turnedAway(const std::shared_ptr<TurnedAwayLog::Door>& door, const std::string& from,
                  const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = Clock::now();
    TurnedAwayLog::Door& d = *door;
    if (d.total > 0 && d.unreported == 0 && now - d.latest >= TurnedAwayLog::kQuiet) {
      d.oneByOneLeft = TurnedAwayLog::kOneByOne;
    }
    ++d.total;
    d.latest = now;
    if (d.oneByOneLeft > 0 && lines_.size() < TurnedAwayLog::kQueued) {
      --d.oneByOneLeft;
      lines_.push_back(oneLine(d, from, why));
    } else {
      if (d.unreported++ == 0) {
        d.since = now;
        due_.push_back(door);
      }
      d.latestFrom = from;
      d.latestWhy = why;
    }
    if (!running_) {
      running_ = true;
      std::thread([this] { run(); }).detach();
    }
    wake_.notify_one();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (!lines_.empty()) {
        const std::string line = std::move(lines_.front());
        lines_.pop_front();
        lock.unlock();
        writeToStderr(line);
        lock.lock();
        continue;
      }
      const auto now = Clock::now();
      auto next = Clock::time_point::max();
      for (auto it = due_.begin(); it != due_.end();) {
        TurnedAwayLog::Door& door = **it;
        if (now >= door.since + TurnedAwayLog::kSummaryEvery) {
          lines_.push_back(summary(door, now));
          door.unreported = 0;
          it = due_.erase(it);
        } else {
          next = std::min(next, door.since + TurnedAwayLog::kSummaryEvery);
          ++it;
        }
      }
      if (!lines_.empty()) {
        continue;
      }
      if (next == Clock::time_point::max()) {
        wake_.wait(lock);
      } else {
        wake_.wait_until(lock, next);
      }
    }
  }

  // A child forked while a thread held the lock would deadlock at its first report; it has no
  // writer thread, and its parent's lines are its parent's to write.
  static void beforeFork() {
    instance().mutex_.lock();
  }
  static void inParent() {
    instance().mutex_.unlock();
  }
  static void inChild() {
    Writer& writer = instance();
    writer.lines_.clear();
    for (const auto& door : writer.due_) {
      door->unreported = 0;
    }
    writer.due_.clear();
    writer.running_ = false;
    writer.mutex_.unlock();
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::string> lines_;
  std::vector<std::shared_ptr<TurnedAwayLog::Door>> due_; // doors with turned-away connections unreported
  bool running_ = false;
};

} // namespace

std::shared_ptr<TurnedAwayLog::Door> TurnedAwayLog::open(int rank, const char* what) {
  auto door = std::make_shared<Door>();
  door->rank = rank;
  door->what = what;
  return door;
}

void TurnedAwayLog::turnedAway(const std::shared_ptr<Door>& door, const std::string& from, const std::string& why) {
  Writer::instance().turnedAway(door, from, why);
}

} // namespace torus
