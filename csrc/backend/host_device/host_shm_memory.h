// The host device layer's arena memory: each rank's arena is a POSIX shared-memory segment
// (filled with 0xff, so that reading what was never written shows), named by the handle that
// SharedArenas passes around, and mapped by the ranks of its host. Once every rank has opened
// what it could, the owner unlinks its name, so nothing is left in /dev/shm whatever happens
// later; the mappings go with the object.
#pragma once

#include <memory>

#include "backend/device_arenas.h"

namespace torus {

std::unique_ptr<ArenaMemory> makeHostShmMemory();

} // namespace torus
