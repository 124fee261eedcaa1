// CallbackScope: whether this thread runs a future's callbacks. Scopes are opened by the
// executor's worker around its job's callbacks, by a point-to-point work around its future's, and
// by the Python shim around every callback given to then() or add_done_callback(), which also
// knows when the callback was attached.
//
// What a scope decides for the collectives issued inside it:
// - where they run: at the callback's place (CallPlace), after every collective issued before the
//   callback was attached and before every one issued after it, and after callbacks attached
//   earlier at the same point. A caller attaches callbacks at fixed points of its program, so the
//   place is the same on every rank, whether the callback ran on the worker when its collective
//   completed or at once inside then() because it had completed already;
// - what their signature says: issued by a callback, so that ranks on which a callback's
//   collective and the caller's still met at one sequence number (a callback attached to a
//   future the program completes itself, run after the caller's next collective started) fail
//   with a mismatch rather than mix their data.
#pragma once

#include <cstdint>
#include <tuple>

namespace torus {

// A call's place in its group's order. A caller's call: (its number among the process's calls,
// 0). A callback's: (the number of calls issued when the callback was attached, the callback's
// number among attached callbacks), which sorts after the calls issued before the callback was
// attached and before those issued after.
struct CallPlace {
  uint64_t point = 0;
  uint64_t attached = 0;

  bool operator<(const CallPlace& other) const {
    return std::tie(point, attached) < std::tie(other.point, other.attached);
  }
};

class CallbackScope {
 public:
  // `owner`: the executor whose worker runs the callbacks of its own job (null elsewhere).
  // `place`: where the callback's collectives go (attachCallback()); point 0 when not known (a
  // callback attached from C++), and then they go where they are issued.
  CallbackScope(const void* owner, CallPlace place);
  ~CallbackScope();
  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;

  // Whether this thread is in callbacks that `owner`'s worker runs.
  static bool inCallbacksOf(const void* owner);
  // CallSignature::origin of a collective issued on this thread now.
  static uint16_t currentOrigin();
  // The place of a collective issued on this thread now; counts it among the process's calls.
  static CallPlace placeNewCall();
  // The place of a callback attached now.
  static CallPlace attachCallback();

 private:
  const void* const owner_;
  const CallPlace place_;
  const CallbackScope* const outer_;
};

} // namespace torus
