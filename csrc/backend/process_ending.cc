#include "backend/process_ending.h"

#include <chrono>
#include <mutex>
#include <thread>

#include "transport/departure.h"

namespace torus {

namespace {

std::mutex enderMutex;
std::thread::id ender;

} // namespace

void markProcessEnding() {
  std::lock_guard<std::mutex> lock(enderMutex);
  ender = std::this_thread::get_id();
  noteProcessEnding();
}

void parkIfProcessEnding() {
  if (!processEnding()) {
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
