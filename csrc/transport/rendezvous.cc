#include "transport/rendezvous.h"

#include <algorithm>

namespace torus {

namespace {

constexpr auto kMaxBackoff = std::chrono::milliseconds(100);

} // namespace

Clock::time_point backoff(int tries) {
  return Clock::now() +
         std::min<Clock::duration>(std::chrono::milliseconds(int64_t{1} << std::min(tries, 7)), kMaxBackoff);
}

std::optional<std::string> lookUpPublished(Rendezvous& rendezvous, const std::string& key, Deadline deadline,
                                           Clock::time_point* nextTry, int* tries, std::string* failure) {
  std::optional<std::string> found;
  try {
    found = rendezvous.tryGet(key);
  } catch (const std::exception& e) {
    *failure = std::string("its address cannot be read from the store: ") + e.what();
    return std::nullopt;
  }
  if (!found && Clock::now() >= deadline) {
    *failure = "it did not publish its address within the timeout (it has not created the group, or failed "
               "before it did)";
  } else if (!found) {
    *nextTry = backoff((*tries)++);
  }
  return found;
}

} // namespace torus
