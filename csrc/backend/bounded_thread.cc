#include "backend/bounded_thread.h"

#include <ctime>
#include <stdexcept>
#include <string>
#include <utility>

namespace torus {

namespace {

void* runBody(void* argument) {
  auto* body = static_cast<std::function<void()>*>(argument);
  (*body)();
  delete body;
  return nullptr;
}

} // namespace

BoundedThread::BoundedThread(std::function<void()> body) {
  auto* owned = new std::function<void()>(std::move(body));
  const int failed = ::pthread_create(&thread_, nullptr, &runBody, owned);
  if (failed != 0) {
    delete owned;
    throw std::runtime_error("torus: cannot start a thread (pthread_create: error " + std::to_string(failed) + ")");
  }
  started_ = true;
}

BoundedThread::~BoundedThread() {
  if (started_) {
    ::pthread_detach(thread_);
  }
}

BoundedThread::BoundedThread(BoundedThread&& other) noexcept : thread_(other.thread_), started_(other.started_) {
  other.started_ = false;
}

BoundedThread& BoundedThread::operator=(BoundedThread&& other) noexcept {
  if (this != &other) {
    if (started_) {
      ::pthread_detach(thread_);
    }
    thread_ = other.thread_;
    started_ = other.started_;
    other.started_ = false;
  }
  return *this;
}

bool BoundedThread::joinWithin(std::chrono::milliseconds patience) {
  if (!started_) {
    return true;
  }
  timespec until{};
  ::clock_gettime(CLOCK_REALTIME, &until);
  const auto nanoseconds = std::chrono::duration_cast<std::chrono::nanoseconds>(patience).count();
  until.tv_sec += static_cast<time_t>(nanoseconds / 1000000000 + (until.tv_nsec + nanoseconds % 1000000000) / 1000000000);
  until.tv_nsec = static_cast<long>((until.tv_nsec + nanoseconds % 1000000000) % 1000000000);
  const bool ended = ::pthread_timedjoin_np(thread_, nullptr, &until) == 0;
  if (!ended) {
    ::pthread_detach(thread_);
  }
  started_ = false;
  return ended;
}

} // namespace torus
