// The warnings about connections a rank turned away (group_secret.h's Gatekeeper), written to
// stderr at a bounded rate by a thread of their own. Turning a connection away happens under a
// transport's lock, on the thread that drives its collectives: there it costs a count and a
// queued line, never a write, so a flood of bad hellos does not keep the progress thread writing,
// and a stderr that stops draining (a pipe nobody reads) stalls only the writer, never a
// collective.
//
// Each door (one Gatekeeper) reports the first kOneByOne connections it turns away with a line
// each, naming the address and why. Past those, one line at most every kSummaryEvery says how many
// more it turned away in that time, and the latest of them. A door that turned none away for
// kQuiet reports the next ones one by one again. While the writer is stalled, at most kQueued
// lines wait; what comes past them is counted into the next summary.
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace torus {

class TurnedAwayLog {
 public:
  static constexpr int kOneByOne = 16;
  static constexpr auto kSummaryEvery = std::chrono::seconds(5);
  static constexpr auto kQuiet = std::chrono::seconds(60);
  static constexpr size_t kQueued = 64;

  // What one door has turned away; its reports read it under the log's lock.
  struct Door;

  // A door of `rank`'s that turns away `what`s ("TCP connection"); it may go before its last
  // summary is written.
  static std::shared_ptr<Door> open(int rank, const char* what);
  // Counts a connection `door` turned away from `from` because `why`, and queues its line (or
  // counts it into the next summary). Never blocks on stderr.
  static void turnedAway(const std::shared_ptr<Door>& door, const std::string& from, const std::string& why);
};

} // namespace torus
