// The Python stacks of every thread of this process, as faulthandler prints them, for the flight
// recorder's dumps: what a rank was doing when it failed or was asked to dump.
#pragma once

#include <string>

namespace torus {

// Faulthandler's text for every thread; empty when the interpreter is not running (not yet, or
// shutting down) or the text cannot be had. Needs no GIL: it reads the threads' frames as
// faulthandler's watchdog does, so a thread that holds the GIL in native code delays nothing.
std::string pythonStacks();

} // namespace torus
