#include "backend/process_ending.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace torus {

namespace {

std::atomic<bool> ending{false};
std::mutex enderMutex;
std::thread::id ender;

} // namespace

void markProcessEnding() {
  std::lock_guard<std::mutex> lock(enderMutex);
  ender = std::this_thread::get_id();
  ending.store(true, std::memory_order_release);
}

void parkIfProcessEnding() {
  if (!ending.load(std::memory_order_acquire)) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(enderMutex);
    if (std::this_thread::get_id() == ender) {
      return;
    }
  }
  for (;;) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

} // namespace torus
