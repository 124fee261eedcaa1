#pragma once

#include "comm/comm.h"

namespace torus {

// Returns once every rank of comm has entered the barrier.
void barrier_dissemination(Comm& comm);

} // namespace torus
