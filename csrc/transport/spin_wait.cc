#include "transport/spin_wait.h"

#include <algorithm>
#include <stdexcept>

namespace torus {

const char* waitPolicyName(WaitPolicy policy) {
  switch (policy) {
    case WaitPolicy::kAuto:
      return "auto";
    case WaitPolicy::kPause:
      return "pause";
    case WaitPolicy::kYield:
      return "yield";
  }
  return "auto";
}

WaitPolicy waitPolicyNamed(const std::string& name) {
  for (WaitPolicy policy : {WaitPolicy::kAuto, WaitPolicy::kPause, WaitPolicy::kYield}) {
    if (name == waitPolicyName(policy)) {
      return policy;
    }
  }
  throw std::invalid_argument("TORUS_WAIT=" + name.substr(0, 64) + ": expected auto, pause or yield");
}

SpinWait::Wait::Wait(const SpinWait& spin, bool peerSharesCore) {
  switch (spin.policy_) {
    case WaitPolicy::kPause:
      pauses_ = true;
      return;
    case WaitPolicy::kYield:
      return;
    case WaitPolicy::kAuto:
      break;
  }
  if (!spin.autoMayPause()) {
    return;
  }
  const int ranks = spin.ranksHere_.load(std::memory_order_relaxed);
  const int cores = spin.coresHere_.load(std::memory_order_relaxed);
  timesYields_ = true;
  if (peerSharesCore) {
    sleepsAtOnce_ = true;
    return;
  }
  places_ = std::max(1, cores / std::max(1, ranks));
  if (spin.ownCores_.load(std::memory_order_relaxed) > places_) {
    unbound_ = true;
    if (callers_.load(std::memory_order_relaxed) > places_) {
      return;
    }
  }
  int pausing = pausing_.load(std::memory_order_relaxed);
  while (pausing < places_) {
    if (pausing_.compare_exchange_weak(pausing, pausing + 1, std::memory_order_relaxed)) {
      holdsPlace_ = true;
      pauses_ = true;
      pauseUntil_ = std::chrono::steady_clock::now() + kPauseBudget;
      return;
    }
  }
}

SpinWait::Wait::~Wait() {
  if (holdsPlace_) {
    pausing_.fetch_sub(1, std::memory_order_relaxed);
  }
}

bool SpinWait::Wait::relax() {
  if (sleepsAtOnce_) {
    return false;
  }
  if (!pauses_) {
    if (!timesYields_) {
      std::this_thread::yield();
      return true;
    }
    const auto before = std::chrono::steady_clock::now();
    std::this_thread::yield();
    return std::chrono::steady_clock::now() - before < kLongYield;
  }
  pause();
  // kAuto looks again every 16th look: a clock read costs about as much as a pause.
  if (!holdsPlace_ || (++looks_ & 15) != 0) {
    return true;
  }
  const bool spent = std::chrono::steady_clock::now() >= pauseUntil_;
  if (spent || (unbound_ && callers_.load(std::memory_order_relaxed) > places_)) {
    // Spent: sleep now. Outnumbered by this process's other callers: yield from here on.
    pauses_ = false;
    holdsPlace_ = false;
    pausing_.fetch_sub(1, std::memory_order_relaxed);
    return !spent;
  }
  return true;
}

} // namespace torus
