// How transports find each other: a key-value store shared by the ranks of a group (the
// backend adapts the c10d::Store that init_process_group hands it).
#pragma once

#include <optional>
#include <string>

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

} // namespace torus
