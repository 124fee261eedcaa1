// How transports find each other: a key-value store shared by the ranks of a group (the
// backend adapts the c10d::Store that init_process_group hands it).
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"

namespace torus {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key is set (or the store's own timeout throws).
  virtual std::string get(const std::string& key) = 0;
  // The values of `keys`, in their order, read in one store operation where the store has one:
  // a rank's setup reads every peer's key at once, so its store operations stay the same however
  // many peers it has. Blocks until every key is set, as get: only for keys that will be.
  virtual std::vector<std::string> multiGet(const std::vector<std::string>& keys) {
    std::vector<std::string> values;
    values.reserve(keys.size());
    for (const auto& key : keys) {
      values.push_back(get(key));
    }
    return values;
  }
  // Whether waitFor works, later and from a thread of the transport's own: not for a store
  // behind Python callbacks that only its creating thread may call.
  virtual bool looksUpFromAnyThread() const {
    return false;
  }
  // Blocks until the key is set, at most `timeout`: its value, or nullopt when it is not set by
  // then; throws when the store fails. Only where looksUpFromAnyThread().
  virtual std::optional<std::string> waitFor(const std::string& key, std::chrono::milliseconds timeout) {
    return std::nullopt;
  }
};

// When to try again after `tries` connections that failed: 1 ms, doubling to 100 ms.
Clock::time_point backoff(int tries);

// The values peers publish under keys of the store (their addresses), looked up when a transport
// first needs them, on a thread of their own: its progress never blocks on the store, and no
// lookup polls. Each is one wait for the key, bounded by the lookup's deadline, then one get.
class PublishedLookups {
 public:
  // `wake` is called, from the lookups' thread, when an answer is in; `rendezvous` must
  // looksUpFromAnyThread().
  PublishedLookups(std::shared_ptr<Rendezvous> rendezvous, std::function<void()> wake);
  // Waits for the thread, if it runs: at most kSlice when it waits for a key.
  ~PublishedLookups();
  PublishedLookups(const PublishedLookups&) = delete;
  PublishedLookups& operator=(const PublishedLookups&) = delete;

  // Without blocking, from a transport's progress: the value published under `key`; or nullopt
  // with *failure empty while it is looked up (the first call starts it; `wake` says when to
  // call again); or nullopt with *failure saying why it never will be (the store failed, or
  // `deadline` passed first).
  std::optional<std::string> lookUp(const std::string& key, Deadline deadline, std::string* failure);

  // How long one wait for a key lasts at most: the thread then looks whether it is to stop,
  // and lets the next key's lookup go first (one peer that never publishes delays the others'
  // by at most this; so does a TCPStore client, which serves one request at a time, delay the
  // rank's other store operations).
  static constexpr auto kSlice = std::chrono::milliseconds(1000);

 private:
  struct Lookup {
    Deadline deadline;
    bool answered = false;
    std::optional<std::string> value;
    std::string failure;
  };
  void run();

  const std::shared_ptr<Rendezvous> rendezvous_;
  const std::function<void()> wake_;
  std::mutex mutex_;
  std::map<std::string, Lookup> lookups_; // by key, until its answer is taken
  std::deque<std::string> waiting_; // the keys not answered yet, the next to wait for first
  bool stopping_ = false;
  // The thread runs while keys wait and ends when none does (a group keeps no idle thread; a
  // process may hold thousands of groups); the next lookup starts it again.
  bool running_ = false;
  std::thread thread_;
};

} // namespace torus
