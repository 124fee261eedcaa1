// The interpreter's end, as daemon threads meet it. Once Python runs its atexit hooks, a daemon
// thread that takes the GIL again is ended by pthread_exit, whose unwinding runs into the
// destructor of the gil_scoped_release that torch's bindings hold around every call into a
// backend; unwinding through a destructor is std::terminate, and the process dies with SIGABRT
// ("terminate called without an active exception": gloo's ranks did in 16 of 16 runs of a daemon
// thread in a sync all_reduce at sys.exit). So a thread other than the one ending the process
// that enters or leaves a torus call after that point never returns to Python: it sleeps until
// the process is gone, which exit() does not wait for.
#pragma once

namespace torus {

// From the atexit hook: the calling thread ends the process.
void markProcessEnding();
// At the entry and the exit of every call a Python thread makes into torus: never returns on a
// thread other than the ending one once the process is ending.
void parkIfProcessEnding();

// Parks at its start and its end (also when the call throws) as parkIfProcessEnding says.
struct PythonCallScope {
  PythonCallScope() {
    parkIfProcessEnding();
  }
  ~PythonCallScope() {
    parkIfProcessEnding();
  }
  PythonCallScope(const PythonCallScope&) = delete;
  PythonCallScope& operator=(const PythonCallScope&) = delete;
};

} // namespace torus
