// SpinWait: how a spinning wait spends its looks before it sleeps (TORUS_WAIT).
//
// A look either pauses in place (x86 `pause`: the core stays this thread's) or yields the core to
// whatever else is runnable there; a wait may also stop spinning and sleep on its doorbell.
// None wins everywhere (BENCHMARKS.md, "Waiting on a busy host", 2 ranks on 2 cores):
// - Pausing wins where a waiting thread has a core of its own: a yield hands the core to a busy
//   process for its time slice, milliseconds, while the peer answers in microseconds.
// - Yielding wins where waiting threads outnumber the cores, and for the group's worker thread,
//   whose own rank computes beside it (a backward pass beside DDP's allreduce).
// - Sleeping wins where the peer is not running: a peer waiting its turn on this very core (the
//   scheduler stacked unbound ranks on one core) runs only once this thread leaves it, and
//   beside six busy processes a yield gave the core to one of them for its slice, while a
//   sleeper is off the queue and is woken the moment its peer rings.
//
// kAuto decides per wait from what holds now, at no syscall per look:
// - Only a thread running its caller's own collective, while the host's ranks have a core each in
//   their current affinity (re-read every kCoresPeriod), may pause; every other wait yields.
// - A peer that last waited on this thread's core (each rank publishes sched_getcpu, a load
//   through rseq, at every wait that does not end at once): sleep at once.
// - This process pauses at most its share of the cores: ranks bound to their share (a launcher's
//   binding) pause that many threads and yield the rest; unbound ranks pause only while no more
//   of their threads run callers' collectives than that (a thread between two waits computes,
//   and a pausing sibling would hold the core it needs), since the scheduler would otherwise
//   stack them.
// - A pause that found nothing for kPauseBudget, or a yield that lost the core for kLongYield:
//   the peer lost its core, or another process holds ours; sleep.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace torus {

enum class WaitPolicy {
  kAuto,
  kPause,
  kYield,
};

// "auto", "pause", "yield".
const char* waitPolicyName(WaitPolicy policy);
// Throws std::invalid_argument naming TORUS_WAIT for any other name.
WaitPolicy waitPolicyNamed(const std::string& name);

class SpinWait {
 public:
  // How often a transport re-reads the ranks' affinity (taskset and cgroups change it at run time).
  static constexpr auto kCoresPeriod = std::chrono::milliseconds(100);
  // How long a pausing wait that finds nothing pauses before it sleeps: a peer that answers
  // within it holds its core; one that does not has likely lost it. Beside a parallel build a
  // peer often answers after 30-50 us (busy_host.py, 2 ranks: 10 us cost 1.28x yield's time per
  // call, 30 us 1.19x, 50 us 1.04x); beside six busy processes a longer one wastes the slice (28,
  // 35 and 53 us per call at 30, 50 and 100 us, where yield took 440).
  static constexpr auto kPauseBudget = std::chrono::microseconds(50);
  // A yield that kept this thread off its core longer than this gave it to another process for
  // its time slice (a peer's turn on a small call takes microseconds): kAuto waits that may pause
  // sleep from then on, leaving the core to their peer's turn.
  static constexpr auto kLongYield = std::chrono::microseconds(50);

  explicit SpinWait(WaitPolicy policy) : policy_(policy) {}

  WaitPolicy policy() const {
    return policy_;
  }

  // `ranksHere`: the group's ranks on this host, this one included; `coresHere`: the cores they
  // may run on together now. Safe beside running waits.
  // `ownCores`: the cores this rank may run on now (at most its share: the rank is bound).
  void setShare(int ranksHere, int coresHere, int ownCores) {
    ranksHere_.store(ranksHere, std::memory_order_relaxed);
    coresHere_.store(coresHere, std::memory_order_relaxed);
    ownCores_.store(ownCores, std::memory_order_relaxed);
  }

  // One wait's looks. Decides at its start whether it may pause, holding one of the process's
  // pausing places while it does.
  class Wait {
   public:
    // `peerSharesCore`: a peer this wait may be waiting for is on this thread's core (kAuto).
    explicit Wait(const SpinWait& spin, bool peerSharesCore = false);
    ~Wait();
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;

    // Whether the next look pauses rather than yields.
    bool pauses() const {
      return pauses_;
    }
    // Whether the wait sleeps without spinning.
    bool sleepsAtOnce() const {
      return sleepsAtOnce_;
    }
    // One look's wait; false: stop spinning and sleep now.
    bool relax();

   private:
    bool pauses_ = false;
    // kAuto: holds one of the process's pausing places.
    bool holdsPlace_ = false;
    // kAuto, unbound ranks: gives the place up once more threads run callers' collectives.
    bool unbound_ = false;
    // kAuto, ranks with a core each, the caller's thread: a long yield ends the spinning.
    bool timesYields_ = false;
    // kAuto: the peer waits its turn on this core; sleep without spinning.
    bool sleepsAtOnce_ = false;
    int places_ = 0;
    // kAuto: when pausing ends and the wait sleeps.
    std::chrono::steady_clock::time_point pauseUntil_;
    unsigned looks_ = 0;
  };

  // While alive, this thread runs a collective its caller waits for, and its waits may keep the
  // core. `callerWaits` false leaves the thread as it was.
  class CallerWaits {
   public:
    explicit CallerWaits(bool callerWaits = true) : prior_(callerWaits_) {
      callerWaits_ = prior_ || callerWaits;
      if (callerWaits_ && !prior_) {
        callers_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    ~CallerWaits() {
      if (callerWaits_ && !prior_) {
        callers_.fetch_sub(1, std::memory_order_relaxed);
      }
      callerWaits_ = prior_;
    }
    CallerWaits(const CallerWaits&) = delete;
    CallerWaits& operator=(const CallerWaits&) = delete;

   private:
    bool prior_;
  };

  // Whether a kAuto wait on this thread may pause now (the caller's thread, ranks with a core
  // each); false under the other policies. Where it may not, a wait needs nothing more to decide.
  bool autoMayPause() const {
    return policy_ == WaitPolicy::kAuto && callerWaits_ &&
           ranksHere_.load(std::memory_order_relaxed) <= coresHere_.load(std::memory_order_relaxed);
  }

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

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

 private:
  const WaitPolicy policy_;
  // Until the transport knows, one rank on no core: every kAuto wait yields.
  std::atomic<int> ranksHere_{1};
  std::atomic<int> coresHere_{0};
  std::atomic<int> ownCores_{0};
  static inline thread_local bool callerWaits_ = false;
  // This process's threads pausing now, of every group.
  static inline std::atomic<int> pausing_{0};
  // This process's threads running callers' collectives (CallerWaits), of every group.
  static inline std::atomic<int> callers_{0};
};

} // namespace torus
