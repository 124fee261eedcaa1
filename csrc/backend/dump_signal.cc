#include "backend/dump_signal.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>


namespace torus {

namespace {

// What ends a waiter instead of asking for a dump (a real request names its rank).
const std::string kStopWaiting;
// Set by the first rank that stops waiting to the number of that rank.
const std::string kEndedKey = "torus/dump/ended";
// A blocking pop is renewed this often: it ends at its store's timeout.
constexpr std::chrono::hours kWaitRenewal{1};
// How often a FileStore's key is checked.
constexpr std::chrono::seconds kPollPeriod{1};

std::string keyOf(int rank) {
  return "torus/dump/" + std::to_string(rank);
}

DumpSignal::WaitKind waitKindOf(const c10::intrusive_ptr<c10d::Store>& store) {
  c10d::Store* base = store.get();
  c10::intrusive_ptr<c10d::Store> underlying;
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base)) {
    underlying = prefixed->getUnderlyingNonPrefixStore();
    base = underlying.get();
  }
  if (dynamic_cast<c10d::TCPStore*>(base) != nullptr || dynamic_cast<c10d::HashStore*>(base) != nullptr) {
    return DumpSignal::WaitKind::kQueue;
  }
  if (dynamic_cast<c10d::FileStore*>(base) != nullptr) {
    return DumpSignal::WaitKind::kPolling;
  }
  return DumpSignal::WaitKind::kNone;
}

// Gives `text` to the waiters of `ranks`: a queue entry each (its pop returns it with the wake-up,
// so a waiter never reads the store after a store that lives in a rank's process went away), or
// one batched write of their keys for the waiters that poll.
void deliver(c10d::Store& store, DumpSignal::WaitKind kind, const std::vector<int>& ranks, const std::string& text) {
  const std::vector<uint8_t> value(text.begin(), text.end());
  if (kind == DumpSignal::WaitKind::kQueue) {
    for (const int rank : ranks) {
      store.queuePush(keyOf(rank), value);
    }
    return;
  }
  std::vector<std::string> keys;
  for (const int rank : ranks) {
    keys.push_back(keyOf(rank));
  }
  store.multiSet(keys, std::vector<std::vector<uint8_t>>(keys.size(), value));
}

} // namespace

// What the waiting thread shares with the group; the thread holds it, so that a thread still
// blocked in a frozen store's call outlives the group harmlessly.
struct DumpSignal::Waiter {
  c10::intrusive_ptr<c10d::Store> store; // a connection of its own when it pops
  std::string key;
  WaitKind kind;
  std::shared_ptr<FlightRecorder> recorder;
  std::mutex mutex;
  std::condition_variable changed;
  bool stopping = false;
  bool ended = false; // run() returned: another rank's stop (or a request) ended the wait

  // The request's text; nullopt when stopping or the store is gone.
  std::optional<std::string> awaitRequest() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        if (kind == WaitKind::kPolling) {
          changed.wait_for(lock, kPollPeriod, [&] { return stopping; });
        }
        if (stopping) {
          return std::nullopt;
        }
      }
      try {
        if (kind == WaitKind::kQueue) {
          const std::vector<uint8_t> value = store->queuePop(key, true);
          return std::string(value.begin(), value.end());
        }
        if (store->check({key})) {
          const std::vector<uint8_t> value = store->get(key);
          return std::string(value.begin(), value.end());
        }
      } catch (const c10::DistStoreError&) {
        // The pop's renewal ran out: pop again. (A store that is gone fails with a network error.)
      } catch (const std::exception&) {
        return std::nullopt;
      }
    }
  }

  void run() {
    const std::optional<std::string> request = awaitRequest();
    // A rank that failed itself has dumped already, with its own failure.
    if (request && *request != kStopWaiting && !recorder->hasFailure()) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!stopping) {
        recorder->dump(*request, "");
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    ended = true;
  }
};

DumpSignal::DumpSignal(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::shared_ptr<FlightRecorder> recorder)
    : store_(store),
      rank_(rank),
      size_(size),
      kind_(size > 1 && recorder->enabled() ? waitKindOf(store) : WaitKind::kNone) {
  if (kind_ == WaitKind::kNone) {
    return;
  }
  auto waiter = std::make_shared<Waiter>();
  if (kind_ == WaitKind::kQueue) {
    waiter->store = store->clone();
    waiter->store->setTimeout(kWaitRenewal);
  } else {
    waiter->store = store;
  }
  waiter->key = keyOf(rank);
  waiter->kind = kind_;
  waiter->recorder = std::move(recorder);
  waiter_ = waiter;
  waiting_ = BoundedThread([waiter] { waiter->run(); });
}

DumpSignal::~DumpSignal() {
  stop(std::chrono::milliseconds(0));
}

void DumpSignal::raise(const std::string& why) {
  if (kind_ == WaitKind::kNone || raised_.exchange(true)) {
    return;
  }
  std::vector<int> others;
  for (int rank = 0; rank < size_; ++rank) {
    if (rank != rank_) {
      others.push_back(rank);
    }
  }
  // Nobody waits for it: a frozen store holds only this thread.
  std::thread([store = store_, kind = kind_, others = std::move(others),
               text = "rank " + std::to_string(rank_) + " failed: " + why] {
    try {
      deliver(*store, kind, others, text);
    } catch (const std::exception&) {
      // The ranks that fail on their own still dump.
    }
  }).detach();
}

void DumpSignal::stop(std::chrono::milliseconds patience) {
  const std::shared_ptr<Waiter> waiter = std::move(waiter_);
  if (!waiter) {
    return;
  }
  bool ended;
  {
    std::lock_guard<std::mutex> lock(waiter->mutex);
    waiter->stopping = true;
    ended = waiter->ended;
  }
  waiter->changed.notify_all();
  const auto until = std::chrono::steady_clock::now() + patience;
  // A waiter that ended needs nothing from the store, which may be gone with the rank that ended it.
  if (kind_ == WaitKind::kQueue && !ended) {
    // The first rank to stop (destroying the group, or its process ending) ends every rank's wait
    // at once: the group runs nothing more, and a store that lives in a rank's process (tcp://,
    // env:// without torchrun) must not go away under pops still open, each of which torch would
    // report with a warning and a stack. A store that does not answer keeps this thread, not us.
    BoundedThread([store = store_, rank = rank_, size = size_] {
      try {
        const std::string me = std::to_string(rank);
        const std::vector<uint8_t> first = store->compareSet(kEndedKey, {}, std::vector<uint8_t>(me.begin(), me.end()));
        if (std::string(first.begin(), first.end()) == me) {
          std::vector<int> all(static_cast<size_t>(size));
          std::iota(all.begin(), all.end(), 0);
          deliver(*store, WaitKind::kQueue, all, kStopWaiting);
        }
      } catch (const std::exception&) {
        // The store is gone: so are the waiters' connections, which ends their pops.
      }
    }).joinWithin(patience);
  }
  waiting_.joinWithin(std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                 until - std::chrono::steady_clock::now())));
}

} // namespace torus
