// How transports find each other: a key-value store shared by the ranks of a group (the
// backend adapts the c10d::Store that init_process_group hands it).
#pragma once

#include <optional>
#include <string>

#include "transport/transport.h"

namespace torus {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key is set (or the store's own timeout throws).
  virtual std::string get(const std::string& key) = 0;
  // Whether tryGet works, later and from any thread (a transport's progress, holding its
  // lock): not for a store behind Python callbacks, which need the interpreter's lock.
  virtual bool looksUpFromAnyThread() const {
    return false;
  }
  // The key's value if it is set, without waiting; only where looksUpFromAnyThread().
  virtual std::optional<std::string> tryGet(const std::string& key) {
    return std::nullopt;
  }
};

// When to look again after `tries` looks that found nothing (or connections that failed): 1 ms,
// doubling to 100 ms.
Clock::time_point backoff(int tries);

// One look, without blocking, for the value a peer publishes under `key` (its address), from a
// transport's progress: the value; or nullopt with *failure empty while it is not there yet
// (*nextTry then set by backoff(*tries)); or nullopt with *failure saying why it never will be
// (the store failed, or `deadline` passed). Only where rendezvous.looksUpFromAnyThread().
std::optional<std::string> lookUpPublished(Rendezvous& rendezvous, const std::string& key, Deadline deadline,
                                           Clock::time_point* nextTry, int* tries, std::string* failure);

} // namespace torus
