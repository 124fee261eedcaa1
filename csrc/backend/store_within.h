// Store calls with a deadline of their own. A frozen host (a kernel hang, an NFS stall, a machine
// losing power) keeps its sockets open and answers nothing, and the group's store may live on it:
// a TCPStore client then waits for its own timeout, which is minutes. So every store call on a
// failure path runs on a thread of its own and is waited for at most a few seconds; a call that
// has not returned by then is left behind, holding what it needs, and the caller goes on with
// what it knows itself.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace torus {

// How long a failure path waits for the store.
constexpr std::chrono::milliseconds kStoreDeadline{2000};

// What a bounded store call gave: its value, or why there is none.
template <typename T>
struct StoreAnswer {
  std::optional<T> value;
  std::string problem; // "did not answer within 2000 ms", or the store's error

  explicit operator bool() const {
    return value.has_value();
  }
};

// Runs `call` on a thread of its own and waits for it at most `limit`.
template <typename T>
StoreAnswer<T> callWithin(std::chrono::milliseconds limit, std::function<T()> call) {
  struct Shared {
    std::mutex mutex;
    std::condition_variable done;
    bool finished = false;
    StoreAnswer<T> answer;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, call = std::move(call)] {
    StoreAnswer<T> answer;
    try {
      answer.value = call();
    } catch (const std::exception& e) {
      answer.problem = std::string("failed: ") + e.what();
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->answer = std::move(answer);
    shared->finished = true;
    shared->done.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mutex);
  if (!shared->done.wait_for(lock, limit, [&] { return shared->finished; })) {
    StoreAnswer<T> late;
    late.problem = "did not answer within " + std::to_string(limit.count()) + " ms";
    return late;
  }
  return std::move(shared->answer);
}

} // namespace torus
