#include "backend/dump_signal.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>


namespace torus {

namespace {

// The value that ends a waiter instead of asking for a dump (a real request names its rank).
const std::string kStopWaiting;
// A blocking wait is renewed this often: a TCPStore wait needs a timeout.
constexpr std::chrono::hours kWaitRenewal{1};
// How often a FileStore's key is checked.
constexpr std::chrono::seconds kPollPeriod{1};

std::string keyOf(int rank) {
  return "torus/dump/" + std::to_string(rank);
}

enum class WaitKind { kNone, kBlocking, kPolling };

WaitKind waitKindOf(const c10::intrusive_ptr<c10d::Store>& store) {
  c10d::Store* base = store.get();
  c10::intrusive_ptr<c10d::Store> underlying;
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base)) {
    underlying = prefixed->getUnderlyingNonPrefixStore();
    base = underlying.get();
  }
  if (dynamic_cast<c10d::TCPStore*>(base) != nullptr || dynamic_cast<c10d::HashStore*>(base) != nullptr) {
    return WaitKind::kBlocking;
  }
  if (dynamic_cast<c10d::FileStore*>(base) != nullptr) {
    return WaitKind::kPolling;
  }
  return WaitKind::kNone;
}

} // namespace

// What the waiting thread shares with the group; the thread holds it, so that a thread still
// blocked in a frozen store's wait outlives the group harmlessly.
struct DumpSignal::Waiter {
  c10::intrusive_ptr<c10d::Store> store; // a connection of its own when blocking
  std::string key;
  WaitKind kind;
  std::shared_ptr<FlightRecorder> recorder;
  std::mutex mutex;
  std::condition_variable changed;
  bool stopping = false;

  // The request's text once the key is set; nullopt when stopping or the store is gone.
  std::optional<std::string> awaitRequest() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        if (stopping) {
          return std::nullopt;
        }
        if (kind == WaitKind::kPolling) {
          changed.wait_for(lock, kPollPeriod, [&] { return stopping; });
          if (stopping) {
            return std::nullopt;
          }
        }
      }
      try {
        if (kind == WaitKind::kBlocking) {
          store->wait({key}, kWaitRenewal);
        } else if (!store->check({key})) {
          continue;
        }
        const std::vector<uint8_t> value = store->get(key);
        return std::string(value.begin(), value.end());
      } catch (const c10::DistStoreError&) {
        // A blocking wait's renewal ran out, or the store is gone: a store that stays gone fails
        // the next wait at once, and a group whose store is gone has nobody left to ask.
        if (kind == WaitKind::kBlocking && !storeAlive()) {
          return std::nullopt;
        }
      } catch (const std::exception&) {
        return std::nullopt;
      }
    }
  }

  bool storeAlive() {
    try {
      store->check({key});
      return true;
    } catch (const std::exception&) {
      return false;
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
  }
};

DumpSignal::DumpSignal(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::shared_ptr<FlightRecorder> recorder)
    : store_(store), rank_(rank), size_(size) {
  const WaitKind kind = size > 1 && recorder->enabled() ? waitKindOf(store) : WaitKind::kNone;
  if (kind == WaitKind::kNone) {
    return;
  }
  auto waiter = std::make_shared<Waiter>();
  waiter->store = kind == WaitKind::kBlocking ? store->clone() : store;
  waiter->key = keyOf(rank);
  waiter->kind = kind;
  waiter->recorder = std::move(recorder);
  waiter_ = waiter;
  waiting_ = BoundedThread([waiter] { waiter->run(); });
}

DumpSignal::~DumpSignal() {
  stop(std::chrono::milliseconds(0));
}

void DumpSignal::raise(const std::string& why) {
  if (size_ < 2 || raised_.exchange(true)) {
    return;
  }
  std::vector<std::string> keys;
  std::vector<std::vector<uint8_t>> values;
  const std::string text = "rank " + std::to_string(rank_) + " failed: " + why;
  for (int rank = 0; rank < size_; ++rank) {
    if (rank != rank_) {
      keys.push_back(keyOf(rank));
      values.emplace_back(text.begin(), text.end());
    }
  }
  // Nobody waits for it: a frozen store holds only this thread.
  std::thread([store = store_, keys = std::move(keys), values = std::move(values)] {
    try {
      store->multiSet(keys, values);
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
  {
    std::lock_guard<std::mutex> lock(waiter->mutex);
    waiter->stopping = true;
  }
  waiter->changed.notify_all();
  const auto until = std::chrono::steady_clock::now() + patience;
  if (waiter->kind == WaitKind::kBlocking) {
    // Its wait ends when the key is set; a store that does not answer keeps these threads, not us.
    BoundedThread([store = store_, key = waiter->key] {
      try {
        store->set(key, kStopWaiting);
      } catch (const std::exception&) {
        // The store is gone: so is the waiter's connection, which ends its wait.
      }
    }).joinWithin(patience);
  }
  waiting_.joinWithin(std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                 until - std::chrono::steady_clock::now())));
}

} // namespace torus
