#include "transport/rendezvous.h"

#include <algorithm>

namespace torus {

namespace {

constexpr auto kMaxBackoff = std::chrono::milliseconds(100);

} // namespace

Clock::time_point backoff(int tries) {
  return Clock::now() +
         std::min<Clock::duration>(std::chrono::milliseconds(int64_t{1} << std::min(tries, 7)), kMaxBackoff);
}

PublishedLookups::PublishedLookups(std::shared_ptr<Rendezvous> rendezvous, std::function<void()> wake)
    : rendezvous_(std::move(rendezvous)), wake_(std::move(wake)) {}

PublishedLookups::~PublishedLookups() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  if (thread_.joinable()) {
    thread_.join();
  }
}

std::optional<std::string> PublishedLookups::lookUp(const std::string& key, Deadline deadline,
                                                    std::string* failure) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = lookups_.find(key);
  if (found == lookups_.end()) {
    lookups_[key].deadline = deadline;
    waiting_.push_back(key);
    if (!running_) {
      if (thread_.joinable()) {
        thread_.join(); // it has left run(): it cleared running_ under this lock
      }
      running_ = true;
      thread_ = std::thread([this] { run(); });
    }
    return std::nullopt;
  }
  if (!found->second.answered) {
    return std::nullopt;
  }
  auto value = std::move(found->second.value);
  *failure = std::move(found->second.failure);
  lookups_.erase(found);
  return value;
}

void PublishedLookups::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (stopping_ || waiting_.empty()) {
      running_ = false;
      return;
    }
    const std::string key = waiting_.front();
    waiting_.pop_front();
    const Deadline deadline = lookups_[key].deadline;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    lock.unlock();
    std::optional<std::string> value;
    std::string failure;
    try {
      value = rendezvous_->waitFor(key, std::clamp<std::chrono::milliseconds>(left, std::chrono::milliseconds(1), kSlice));
    } catch (const std::exception& e) {
      failure = std::string("its address cannot be read from the store: ") + e.what();
    }
    if (!value && failure.empty() && Clock::now() >= deadline) {
      failure = "it did not publish its address within the timeout (it has not created the group, or failed "
                "before it did)";
    }
    lock.lock();
    Lookup& lookup = lookups_[key];
    if (!value && failure.empty()) {
      waiting_.push_back(key); // the others' turn first
      continue;
    }
    lookup.answered = true;
    lookup.value = std::move(value);
    lookup.failure = std::move(failure);
    lock.unlock();
    wake_();
    lock.lock();
  }
}

} // namespace torus
