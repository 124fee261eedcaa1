#include "python_stacks.h"

#include <Python.h>
#include <frameobject.h>

#include <chrono>
#include <cstdio>

#include "backend/store_within.h"
#include "transport/departure.h"

namespace torus {

namespace {

bool interpreterRunning() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Faulthandler's caps: 100 threads, 100 frames each.
constexpr int kMaxThreads = 100;
constexpr int kMaxFrames = 100;
// How long a reader without the GIL waits for it: a thread that keeps it longer (native code
// that never releases it) would otherwise hold up the failure being reported.
constexpr std::chrono::milliseconds kGilPatience{1000};

// `object`'s str, or "???" as faulthandler writes what it cannot read.
std::string text(PyObject* object) {
  const char* utf8 = object != nullptr && PyUnicode_Check(object) ? PyUnicode_AsUTF8(object) : nullptr;
  if (utf8 == nullptr) {
    PyErr_Clear();
    return "???";
  }
  return utf8;
}

std::string attribute(PyObject* object, const char* name) {
  PyObject* value = PyObject_GetAttrString(object, name);
  std::string result = text(value);
  Py_XDECREF(value);
  return result;
}

// Faulthandler's text, the newest thread first, from sys._current_frames(), which walks the
// interpreter's threads under its lock. Needs the GIL.
std::string stacksHoldingGil() {
  PyObject* currentFrames = PySys_GetObject("_current_frames"); // borrowed
  PyObject* frames = currentFrames != nullptr ? PyObject_CallNoArgs(currentFrames) : nullptr;
  if (frames == nullptr || !PyDict_Check(frames)) {
    Py_XDECREF(frames);
    PyErr_Clear();
    return "";
  }
  const unsigned long me = PyThread_get_thread_ident();
  std::string out;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t position = 0;
  int threads = 0;
  while (PyDict_Next(frames, &position, &key, &value)) {
    if (threads > 0) {
      out += "\n";
    }
    if (threads++ == kMaxThreads) {
      out += "...\n";
      break;
    }
    const unsigned long id = PyLong_AsUnsignedLong(key);
    PyErr_Clear();
    char header[96];
    std::snprintf(header, sizeof(header), "%s 0x%016lx (most recent call first):\n",
                  id == me ? "Current thread" : "Thread", id);
    out += header;
    if (!PyFrame_Check(value)) {
      continue;
    }
    PyFrameObject* frame = reinterpret_cast<PyFrameObject*>(value);
    Py_INCREF(frame);
    for (int depth = 0; frame != nullptr; ++depth) {
      if (depth == kMaxFrames) {
        out += "  ...\n";
        Py_DECREF(frame);
        break;
      }
      PyCodeObject* code = PyFrame_GetCode(frame);
      out += "  File \"" + attribute(reinterpret_cast<PyObject*>(code), "co_filename") + "\", line " +
             std::to_string(PyFrame_GetLineNumber(frame)) + " in " +
             attribute(reinterpret_cast<PyObject*>(code), "co_name") + "\n";
      Py_DECREF(code);
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
  }
  Py_DECREF(frames);
  return out;
}

} // namespace

std::string pythonStacks() {
  if (!interpreterRunning() || processEnding()) {
    return "";
  }
  if (PyGILState_Check()) {
    return stacksHoldingGil();
  }
  // Read by a thread of its own that takes the GIL: one left waiting for it is left behind.
  try {
    const StoreAnswer<std::string> read = callWithin<std::string>(kGilPatience, [] {
      if (!interpreterRunning() || processEnding()) {
        return std::string();
      }
      const PyGILState_STATE state = PyGILState_Ensure();
      std::string text = stacksHoldingGil();
      PyGILState_Release(state);
      return text;
    });
    if (read) {
      return *read.value;
    }
    return "Python stacks not read: the thread taking the GIL for them " + read.problem + "\n";
  } catch (const std::exception& e) {
    return std::string("Python stacks not read: ") + e.what() + "\n";
  }
}

} // namespace torus
