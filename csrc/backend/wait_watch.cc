#include "backend/wait_watch.h"

#include <algorithm>

#include "backend/log.h"

namespace torus {

WaitWatch::WaitWatch(int rank, std::chrono::milliseconds after)
    : rank_(rank), after_(after), thread_(&WaitWatch::loop, this) {}

WaitWatch::~WaitWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

WaitWatch::Waiting::Waiting(WaitWatch* watch, std::function<std::string()> describe,
                            const std::atomic<int64_t>& finishedAt)
    : watch_(watch) {
  if (watch_ == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(watch_->mutex_);
  id_ = ++watch_->nextId_;
  watch_->waiting_.emplace(id_, Entry{std::move(describe), &finishedAt, false});
}

WaitWatch::Waiting::~Waiting() {
  if (watch_ == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(watch_->mutex_);
  watch_->waiting_.erase(id_);
}

void WaitWatch::loop() {
  const auto period = std::clamp(after_ / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!changed_.wait_for(lock, period, [&] { return stopping_; })) {
    const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    const int64_t limit = std::chrono::duration_cast<std::chrono::nanoseconds>(after_).count();
    for (auto& [id, entry] : waiting_) {
      const int64_t finished = entry.finishedAt->load(std::memory_order_acquire);
      if (entry.reported || finished == 0 || now - finished < limit) {
        continue;
      }
      entry.reported = true;
      logLine(rank_, entry.describe() + " completed " + std::to_string((now - finished) / 1000000) +
                         " ms ago, but its wait() has not returned: the caller is stuck after the collective "
                         "(in synchronize(), a lock, or a callback of its future)");
    }
  }
}

} // namespace torus
