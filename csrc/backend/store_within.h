// Store calls with a deadline of their own. A frozen host (a kernel hang, an NFS stall, a machine
// losing power) keeps its sockets open and answers nothing, and the group's store may live on it:
// a TCPStore client then waits for its own timeout, which is minutes. So every store call on a
// failure path runs on a thread of its own and is waited for at most a few seconds; a call that
// has not returned by then is left behind, holding what it needs, and the caller goes on with
// what it knows itself.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "backend/bounded_thread.h"

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
  // Written by the thread, read here only once it has been joined.
  auto answer = std::make_shared<StoreAnswer<T>>();
  BoundedThread thread([answer, call = std::move(call)] {
    try {
      answer->value = call();
    } catch (const std::exception& e) {
      answer->problem = std::string("failed: ") + e.what();
    }
  });
  if (!thread.joinWithin(limit)) {
    StoreAnswer<T> late;
    late.problem = "did not answer within " + std::to_string(limit.count()) + " ms";
    return late;
  }
  return std::move(*answer);
}

} // namespace torus
