// One line to stderr, tagged with the rank, for TORUS_LOG_LEVEL=info/debug output.
#pragma once

#include <cstdio>
#include <string>

namespace torus {

inline void logLine(int rank, const std::string& message) {
  std::fprintf(stderr, "[torus rank %d] %s\n", rank, message.c_str());
  std::fflush(stderr);
}

} // namespace torus
