// The Python stacks of every thread of this process, as faulthandler prints them, for the flight
// recorder's dumps: what a rank was doing when it failed or was asked to dump.
#pragma once

#include <string>

namespace torus {

// Faulthandler's text for every thread that runs Python; empty when the interpreter is not
// running (not yet, or shutting down) or the text cannot be had. Read under the GIL, through
// sys._current_frames: faulthandler's own walk of the threads, which needs no GIL, crashed the
// process when it met a thread entering Python for the first time (that thread links its state
// without the GIL) or a frame being popped. A caller without the GIL has a thread of its own take
// it, and after a second of another thread keeping it gets a line saying so instead.
std::string pythonStacks();

} // namespace torus
