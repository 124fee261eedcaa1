#include "backend/arrival_board.h"

#include <algorithm>
#include <sstream>
#include <vector>

namespace torus {

namespace {

constexpr std::chrono::milliseconds kMaxPublishDelay{250};
constexpr size_t kRanksNamed = 16;

} // namespace

ArrivalBoard::ArrivalBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
    : store_(std::move(store)), rank_(rank), size_(size), thread_(&ArrivalBoard::run, this) {}

ArrivalBoard::~ArrivalBoard() {
  stop();
}

void ArrivalBoard::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

std::string ArrivalBoard::keyOf(int rank) const {
  return "torus/reached/" + std::to_string(rank);
}

void ArrivalBoard::entered(uint64_t seq, std::chrono::milliseconds timeout) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    current_ = seq;
    publishAt_ = std::chrono::steady_clock::now() + std::min(kMaxPublishDelay, timeout / 4);
    wake = publishAt_ < wakeAt_;
  }
  // Only a collective due before the thread's next look needs a wake-up (a group timeout under
  // a second): a wake-up per collective would cost small collectives a context switch each.
  if (wake) {
    changed_.notify_all();
  }
}

uint64_t ArrivalBoard::current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_;
}

void ArrivalBoard::left() {
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = 0;
}

void ArrivalBoard::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  uint64_t attempted = 0; // written or not, a collective is offered to the store once
  while (!stopping_) {
    const auto now = std::chrono::steady_clock::now();
    const bool pending = current_ != 0 && current_ != attempted;
    if (pending && now >= publishAt_) {
      const uint64_t seq = current_;
      attempted = seq;
      lock.unlock();
      bool written = true;
      try {
        store_->set(keyOf(rank_), std::to_string(seq));
      } catch (const std::exception&) {
        // A store that is gone leaves timeout errors without the missing ranks; nothing else needs it.
        written = false;
      }
      lock.lock();
      if (written) {
        published_ = seq;
      }
      continue;
    }
    // Look again when the collective in progress is due, else after the longest delay: a
    // collective entered meanwhile is due no sooner (entered() wakes the thread if it is).
    wakeAt_ = pending ? publishAt_ : now + kMaxPublishDelay;
    changed_.wait_until(lock, wakeAt_);
  }
}

std::string ArrivalBoard::describeMissing(uint64_t seq) const {
  if (seq == 0) { // not started here: no rank is late for it yet
    return {};
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (published_ < seq) {
      return {};
    }
  }
  std::vector<int> missing;
  try {
    for (int rank = 0; rank < size_; ++rank) {
      // add(key, 0) reads a number without blocking: an absent key reads as 0.
      if (rank != rank_ && static_cast<uint64_t>(store_->add(keyOf(rank), 0)) < seq) {
        missing.push_back(rank);
      }
    }
  } catch (const std::exception&) {
    return {};
  }
  std::ostringstream out;
  const std::string collective = "#" + std::to_string(seq);
  if (missing.empty()) {
    out << "every rank had reached " << collective;
    return out.str();
  }
  out << (missing.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < missing.size() && i < kRanksNamed; ++i) {
    out << (i ? ", " : "") << missing[i];
  }
  if (missing.size() > kRanksNamed) {
    out << " and " << missing.size() - kRanksNamed << " more";
  }
  out << " had not reached " << collective;
  return out.str();
}

} // namespace torus
