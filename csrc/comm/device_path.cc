#include "comm/device_path.h"

namespace torus {

std::string DevicePhase::describe() const {
  std::string text = step;
  if (round >= 0) {
    text += ", round " + std::to_string(round);
  }
  if (peer >= 0) {
    text += ", peer rank " + std::to_string(peer);
  }
  return text;
}

} // namespace torus
