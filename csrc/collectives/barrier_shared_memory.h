#pragma once

#include "comm/comm.h"

namespace torus {

// Returns once every rank of comm has entered the barrier; comm must offer shared memory.
void barrier_shared_memory(Comm& comm);

} // namespace torus
