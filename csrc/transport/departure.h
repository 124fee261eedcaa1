// How a rank leaves its group, as its farewell tells its peers: it destroyed the group
// (destroy_process_group, shutdown), or its process ended with the group alive (the script
// returned, raised or called sys.exit, and the interpreter's exit hooks tore the group down). The
// two call for different advice, so a peer's error says which it was.
#pragma once

#include <cstdint>
#include <string>

namespace torus {

enum class Departure : uint64_t { kGroupDestroyed = 0, kProcessEnded = 1 };

// From the interpreter's exit hook: farewells said from now on are kProcessEnded.
void noteProcessEnding();
// The farewell this process says now.
Departure currentDeparture();
// Whether the process is ending (noteProcessEnding was called).
bool processEnding();
// "rank 3 left the group (destroyed its process group)", or "rank 3 ended without destroying its
// process group (...)".
std::string departureText(int rank, Departure departure);

} // namespace torus
