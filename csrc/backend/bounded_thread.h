// BoundedThread: a thread that is joined when it ends in time and left behind when it does not.
// The failure path's threads may sit in a frozen store's call for minutes; shutting a group down
// must neither wait for them nor, in the usual case, leave a thread that outlives the group (a
// job that creates and destroys groups would see threads pile up). pthread_timedjoin_np does both.
#pragma once

#include <pthread.h>

#include <chrono>
#include <functional>

namespace torus {

class BoundedThread {
 public:
  BoundedThread() = default;
  explicit BoundedThread(std::function<void()> body);
  // Leaves a thread still running behind (never waits).
  ~BoundedThread();
  BoundedThread(BoundedThread&& other) noexcept;
  BoundedThread& operator=(BoundedThread&& other) noexcept;
  BoundedThread(const BoundedThread&) = delete;
  BoundedThread& operator=(const BoundedThread&) = delete;

  // Joins the thread if it ends within `patience`, else leaves it running on its own; whether it
  // ended. What the body touches must then be its own (held by shared pointers).
  bool joinWithin(std::chrono::milliseconds patience);

 private:
  pthread_t thread_{};
  bool started_ = false;
};

} // namespace torus
