#include "backend/callback_scope.h"

#include <atomic>

#include "transport/transport.h"

namespace torus {

namespace {

thread_local const CallbackScope* innermost = nullptr;

// Calls issued and callbacks attached in this process, over every group.
std::atomic<uint64_t> callsIssued{0};
std::atomic<uint64_t> callbacksAttached{0};

} // namespace

CallbackScope::CallbackScope(const void* owner, CallPlace place) : owner_(owner), place_(place), outer_(innermost) {
  innermost = this;
}

CallbackScope::~CallbackScope() {
  innermost = outer_;
}

bool CallbackScope::inCallbacksOf(const void* owner) {
  for (const CallbackScope* scope = innermost; scope != nullptr; scope = scope->outer_) {
    if (scope->owner_ == owner) {
      return true;
    }
  }
  return false;
}

uint16_t CallbackScope::currentOrigin() {
  return innermost == nullptr ? CallSignature::kOriginCaller : CallSignature::kOriginCallback;
}

CallPlace CallbackScope::placeNewCall() {
  const uint64_t number = callsIssued.fetch_add(1, std::memory_order_acq_rel) + 1;
  // Only the innermost callback's place: a callback attached from C++, run by the worker inside
  // another callback, goes where it is issued, not where the outer one was attached.
  if (innermost != nullptr && innermost->place_.point != 0) {
    return innermost->place_;
  }
  return CallPlace{number, 0};
}

CallPlace CallbackScope::attachCallback() {
  return CallPlace{callsIssued.load(std::memory_order_acquire),
                   callbacksAttached.fetch_add(1, std::memory_order_acq_rel) + 1};
}

} // namespace torus
