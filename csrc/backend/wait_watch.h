// The debug mode's watch over Work.wait() (TORUS_LOG_LEVEL=debug): a wait that has not returned
// `after` past the completion of its collective is reported once, naming the collective: a
// caller stuck after its collective finished, as a lock taken twice leaves it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace torus {

class WaitWatch {
 public:
  WaitWatch(int rank, std::chrono::milliseconds after);
  ~WaitWatch();
  WaitWatch(const WaitWatch&) = delete;
  WaitWatch& operator=(const WaitWatch&) = delete;

  // For the scope of one wait(): `finishedAt` is the work's completion time (steady clock, ns;
  // 0 while running), `describe` names it. Does nothing without a watch.
  class Waiting {
   public:
    Waiting(WaitWatch* watch, std::function<std::string()> describe, const std::atomic<int64_t>& finishedAt);
    ~Waiting();
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    WaitWatch* const watch_;
    uint64_t id_ = 0;
  };

 private:
  struct Entry {
    std::function<std::string()> describe;
    const std::atomic<int64_t>* finishedAt;
    bool reported;
  };
  void loop();

  const int rank_;
  const std::chrono::milliseconds after_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  uint64_t nextId_ = 0;
  std::map<uint64_t, Entry> waiting_;
  std::thread thread_;
};

} // namespace torus
