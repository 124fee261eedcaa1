#include "backend/arrival_board.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "backend/store_within.h"

namespace torus {

namespace {

constexpr std::chrono::milliseconds kMaxPublishDelay{250};
constexpr size_t kRanksNamed = 16;

} // namespace

ArrivalBoard::ArrivalBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
    : store_(std::move(store)), rank_(rank), size_(size) {}

std::shared_ptr<ArrivalBoard> ArrivalBoard::create(c10::intrusive_ptr<c10d::Store> store, int rank, int size) {
  std::shared_ptr<ArrivalBoard> board(new ArrivalBoard(std::move(store), rank, size));
  // Every rank's key exists from creation on, so that one batched read finds them all rather
  // than wait for a rank that has published nothing yet.
  board->store_->set(board->keyOf(rank), std::string("0"));
  board->thread_ = BoundedThread([board] { board->run(); });
  return board;
}

void ArrivalBoard::stop(std::chrono::milliseconds patience) {
  BoundedThread thread;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    thread = std::move(thread_);
  }
  changed_.notify_all();
  thread.joinWithin(patience);
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
      // A store that is gone or frozen leaves timeout errors without the missing ranks; nothing
      // else needs it, and stop() waits for this thread no longer than the deadline.
      const bool written = static_cast<bool>(callWithin<bool>(kStoreDeadline, [store = store_, key = keyOf(rank_), seq] {
        store->set(key, std::to_string(seq));
        return true;
      }));
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
  // One batched read of every other rank's number, under a deadline of its own.
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int rank = 0; rank < size_; ++rank) {
    if (rank != rank_) {
      keys.push_back(keyOf(rank));
      ranks.push_back(rank);
    }
  }
  const std::string collective = "#" + std::to_string(seq);
  auto read = callWithin<std::vector<std::vector<uint8_t>>>(kStoreDeadline,
                                                           [store = store_, keys] { return store->multiGet(keys); });
  if (!read || read.value->size() != keys.size()) {
    return "which ranks had not reached " + collective + " is not known: the group's store " +
           (read ? std::string("gave a wrong number of values") : read.problem);
  }
  std::vector<int> missing;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string text((*read.value)[i].begin(), (*read.value)[i].end());
    char* end = nullptr;
    const unsigned long long reached = std::strtoull(text.c_str(), &end, 10);
    // A value that is no number is another writer's: that rank is not known to have arrived.
    if (text.empty() || *end != '\0' || reached < seq) {
      missing.push_back(ranks[i]);
    }
  }
  std::ostringstream out;
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
