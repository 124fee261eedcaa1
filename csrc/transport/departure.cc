#include "transport/departure.h"

#include <atomic>

#include "transport/transport.h"

namespace torus {

namespace {

std::atomic<bool> ending{false};

} // namespace

void noteProcessEnding() {
  ending.store(true, std::memory_order_release);
}

bool processEnding() {
  return ending.load(std::memory_order_acquire);
}

Departure currentDeparture() {
  return processEnding() ? Departure::kProcessEnded : Departure::kGroupDestroyed;
}

std::string departureText(int rank, Departure departure) {
  if (departure == Departure::kProcessEnded) {
    return rankName(rank) + " ended without destroying its process group (its script returned, raised or exited " +
           "while this rank still needed it)";
  }
  return rankName(rank) + " left the group (destroyed its process group)";
}

} // namespace torus
