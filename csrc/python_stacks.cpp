#include "python_stacks.h"

#include <Python.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

// CPython's own (faulthandler's) dump of every thread's stack, exported though its header is
// internal: the one way to read the stacks from a thread that cannot take the GIL.
extern "C" const char* _Py_DumpTracebackThreads(int fd, PyInterpreterState* interp, PyThreadState* current);

namespace torus {

namespace {

bool interpreterRunning() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Faulthandler caps a dump at 100 threads and 100 frames each; a megabyte holds that.
constexpr size_t kMaxStackText = 1 << 20;

} // namespace

std::string pythonStacks() {
  if (!interpreterRunning()) {
    return "";
  }
  const int fd = ::memfd_create("torus-python-stacks", MFD_CLOEXEC);
  if (fd < 0) {
    return "";
  }
  const char* problem = _Py_DumpTracebackThreads(fd, PyInterpreterState_Main(), nullptr);
  std::string text;
  if (problem == nullptr) {
    text.resize(kMaxStackText);
    size_t got = 0;
    ::lseek(fd, 0, SEEK_SET);
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        break;
      }
      got += static_cast<size_t>(n);
    }
    text.resize(got);
  }
  ::close(fd);
  return text;
}

} // namespace torus
