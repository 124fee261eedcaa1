// SpinWait: what one look of a spinning wait does before it looks again.
//
// A wait pauses in place only on a thread that runs its caller's own collective (the calling-
// thread path: the rank has nothing else to run meanwhile) and only where the group's ranks on
// this host have a core each: no more ranks than the cores in the union of their affinity masks
// (a launcher that binds each rank to a core of its own gives each one core, and their union
// the ranks' count). There a yield would hand the core to whichever other process is
// runnable on it (a data loader, a compiler), which keeps it for its time slice, milliseconds,
// while the peer on another core answers in microseconds (BENCHMARKS.md, "Waiting with a core per
// rank on a busy host"). Everywhere else each look yields: ranks that outnumber the cores let the
// peer queued behind them on the same core run, and the group's worker thread lets its rank's
// own thread compute (a backward pass beside DDP's allreduce).
#pragma once

#include <sched.h>

#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace torus {

class SpinWait {
 public:
  // Yields at every look: the choice until the ranks' cores are known.
  SpinWait() = default;
  // `ranksHere`: the group's ranks on this host, this one included; `coresHere`: the cores they
  // may run on, together.
  SpinWait(int ranksHere, int coresHere) : yields_(ranksHere > coresHere) {}

  // Whether a look on this thread pauses in place rather than yields.
  bool keepsCore() const {
    return !yields_ && callerWaits_;
  }

  void relax() const {
    if (!keepsCore()) {
      std::this_thread::yield();
      return;
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // While alive, this thread runs a collective its caller waits for, and its waits may keep the
  // core. `callerWaits` false leaves the thread as it was.
  class CallerWaits {
   public:
    explicit CallerWaits(bool callerWaits = true) : prior_(callerWaits_) {
      callerWaits_ = prior_ || callerWaits;
    }
    ~CallerWaits() {
      callerWaits_ = prior_;
    }
    CallerWaits(const CallerWaits&) = delete;
    CallerWaits& operator=(const CallerWaits&) = delete;

   private:
    bool prior_;
  };

  // The cores this process may run on (its affinity mask: taskset, a launcher's binding, cgroups'
  // cpusets); core 0 alone when the kernel will not say.
  static cpu_set_t usableCores() {
    cpu_set_t cores;
    CPU_ZERO(&cores);
    if (sched_getaffinity(0, sizeof(cores), &cores) != 0) {
      CPU_ZERO(&cores);
      CPU_SET(0, &cores);
    }
    return cores;
  }

 private:
  bool yields_ = true;
  static inline thread_local bool callerWaits_ = false;
};

} // namespace torus
