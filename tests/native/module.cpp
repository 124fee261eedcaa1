// torus_testing: the test-only entry points, a module of their own that tests/torus_testing.py
// builds when a test first needs it, linked against the torch_torus._C under test. The package
// never holds them.
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device_collectives_on_host.h"
#include "reduce_kernels.h"
#include "subset_comms.h"
#ifdef TORUS_WITH_OFI
#include "ofi_adversary.h"
#endif
#include "transport/hmac.h"
#include "transport/shm/shared_tensor_arena.h"
#include "python_stacks.h"
#include "transport/spin_wait.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  torus::defineSubsetComms(module);
  torus::defineDeviceCollectivesOnHost(module);
  torus::defineReduceKernels(module);
#ifdef TORUS_WITH_OFI
  torus::defineOfiAdversary(module);
#endif
  module.def(
      "hmac_sha256",
      [](const py::bytes& key, const py::bytes& message) {
        const torus::Digest digest = torus::hmacSha256(key, message);
        return py::bytes(reinterpret_cast<const char*>(digest.data()), digest.size());
      },
      py::arg("key"), py::arg("message"), "HMAC-SHA256 as the transports' hellos prove with it (test_auth.py).");
  module.def("shared_tensor_claim_problem", &torus::SharedTensorArena::claimProblem, py::arg("address"),
             py::arg("nbytes"), py::arg("segment_base"), py::arg("segment_bytes"),
             "What the shm transport finds wrong with a peer's posted buffer in its segment (test_shared_tensors.py).");
  module.def("shared_tensor_file_problem", &torus::SharedTensorArena::fileProblem, py::arg("target"),
             py::arg("file_bytes"), py::arg("segment_bytes"),
             "What it finds wrong with the file behind the fd a peer named (test_shared_tensors.py).");
  module.def(
      "spin_wait_first_look",
      [](const std::string& policy, int ranksHere, int coresHere, int ownCores, bool callerWaits,
         bool peerSharesCore, int otherCallers) {
        torus::SpinWait spin(torus::waitPolicyNamed(policy));
        spin.setShare(ranksHere, coresHere, ownCores);
        // Each other caller: a thread of its own in a caller's collective, waiting (and pausing
        // where it may) until this look is decided.
        std::mutex mutex;
        std::condition_variable changed;
        int waiting = 0;
        bool decided = false;
        std::vector<std::thread> others;
        for (int i = 0; i < otherCallers; ++i) {
          others.emplace_back([&] {
            const torus::SpinWait::CallerWaits scope;
            const torus::SpinWait::Wait wait(spin);
            std::unique_lock<std::mutex> lock(mutex);
            ++waiting;
            changed.notify_all();
            changed.wait(lock, [&] { return decided; });
          });
        }
        std::string look;
        {
          std::unique_lock<std::mutex> lock(mutex);
          changed.wait(lock, [&] { return waiting == otherCallers; });
          const torus::SpinWait::CallerWaits scope(callerWaits);
          const torus::SpinWait::Wait wait(spin, peerSharesCore);
          look = wait.sleepsAtOnce() ? "sleep" : wait.pauses() ? "pause" : "yield";
          decided = true;
          changed.notify_all();
        }
        for (auto& other : others) {
          other.join();
        }
        return look;
      },
      py::arg("policy"), py::arg("ranks_here"), py::arg("cores_here"), py::arg("own_cores"), py::arg("caller_waits"),
      py::arg("peer_shares_core"), py::arg("other_callers"),
      "What a shm wait's first look does, with `other_callers` threads of this process in callers' collectives, "
      "waiting, begun before it (test_shm.py).");
  module.def(
      "spin_wait_pause_ends",
      [] {
        torus::SpinWait spin(torus::WaitPolicy::kAuto);
        spin.setShare(1, 1, 1);
        const torus::SpinWait::CallerWaits scope;
        torus::SpinWait::Wait wait(spin);
        const bool paused = wait.pauses();
        const auto giveUp = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (wait.relax()) {
          if (std::chrono::steady_clock::now() > giveUp) {
            return false;
          }
        }
        return paused;
      },
      "Whether an auto wait that paused and found nothing ends its spinning (to sleep) (test_shm.py).");
  module.def(
      "spin_wait_scopes",
      [] {
        torus::SpinWait spin(torus::WaitPolicy::kAuto);
        spin.setShare(1, 1, 1);
        const auto pauses = [&] { return torus::SpinWait::Wait(spin).pauses(); };
        std::vector<bool> seen{pauses()};
        {
          const torus::SpinWait::CallerWaits outer;
          seen.push_back(pauses());
          {
            const torus::SpinWait::CallerWaits inner;
            seen.push_back(pauses());
          }
          seen.push_back(pauses());
        }
        seen.push_back(pauses());
        return seen;
      },
      "Whether an auto wait pauses before, inside two nested CallerWaits scopes, between and after them "
      "(test_shm.py).");
  module.def(
      "python_stacks_beside_new_threads",
      [](int reads, int threads) {
        // Threads that enter Python and leave it over and over: each entry creates the thread's
        // state and links it into the interpreter's list without the GIL, each exit frees it.
        std::atomic<bool> stop{false};
        std::vector<std::thread> churn;
        for (int i = 0; i < threads; ++i) {
          churn.emplace_back([&stop] {
            while (!stop.load(std::memory_order_relaxed)) {
              const PyGILState_STATE state = PyGILState_Ensure();
              PyGILState_Release(state);
            }
          });
        }
        std::vector<std::string> holding;
        std::vector<std::string> without;
        for (int i = 0; i < reads; ++i) {
          {
            py::gil_scoped_release letChurnRun;
          }
          holding.push_back(torus::pythonStacks());
        }
        {
          py::gil_scoped_release release;
          for (int i = 0; i < reads; ++i) {
            std::thread reader([&without] { without.push_back(torus::pythonStacks()); });
            reader.join();
          }
          stop.store(true);
          for (auto& thread : churn) {
            thread.join();
          }
        }
        return py::make_tuple(holding, without);
      },
      py::arg("reads"), py::arg("threads"),
      "torch_torus' Python stacks read `reads` times under the GIL and as often from a thread without it, while "
      "`threads` native threads enter and leave Python (test_python_stacks.py).");
  module.def(
      "python_stacks_while_gil_kept",
      [](int keepMs) {
        // This thread keeps the GIL in native code while another, without it, asks for the stacks.
        std::string text;
        std::thread reader([&text] { text = torus::pythonStacks(); });
        std::this_thread::sleep_for(std::chrono::milliseconds(keepMs));
        {
          py::gil_scoped_release release;
          reader.join();
        }
        return text;
      },
      py::arg("keep_ms"),
      "The Python stacks asked for by a thread without the GIL while this one keeps it for `keep_ms` "
      "(test_python_stacks.py).");
  module.def(
      "usable_cores",
      [] {
        const cpu_set_t cores = torus::SpinWait::usableCores();
        return CPU_COUNT(&cores);
      },
      "How many cores SpinWait finds this process may run on (test_shm.py).");
}
