// The monitored barrier: torch's tool for finding the rank that hangs, with gloo's semantics and
// texts (torch's tests and users' tools match them).
//
// n ranks: every rank other than 0 sends rank 0 its arrival (8 bytes) and waits for rank 0's
// verdict (16 bytes: how many ranks failed, the first of them): n-1 messages into rank 0 and n-1
// out of it. Rank 0 waits for the arrivals in rank order. Without waitAllRanks the whole call has
// the timeout and rank 0 raises at the first rank that has not arrived; with it, each rank gets
// the whole timeout and rank 0 raises naming every rank that did not arrive. Either way rank 0
// sends every other rank the failed verdict, so that those that arrived raise at once rather
// than at their own timeout, and those still to come raise when they arrive: every rank passes
// the barrier, or none does. A rank other than 0 waits for the verdict up to the group's timeout
// plus what rank 0 may spend on the others.
//
// Point-to-point messages posted from the calling thread, as gloo's are, beside queued
// collectives; each call has tags of its own (ranks count their calls), above every user tag.
// A failed barrier leaves the group usable: a rank that was only late finds its arrival taken
// by the receive still posted for it.
#include <array>
#include <sstream>

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/torus_work.h"

namespace torus {

namespace {

// User tags are ints: kP2PTagBase + 2^32 and above are out of their reach.
constexpr uint64_t kMonitoredBarrierTagBase = kP2PTagBase + (uint64_t(1) << 32);

enum VerdictField { kFailedRanks, kFirstFailedRank, kVerdictFields };
using Verdict = std::array<int64_t, kVerdictFields>;

std::string joined(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out << (i ? ", " : "") << ranks[i];
  }
  return out.str();
}

[[noreturn]] void raise(const std::string& what) {
  C10_THROW_ERROR(DistBackendError, what);
}

// What a transport failure says, a timeout with its length.
std::string describeFailure(const CommError& error, std::chrono::milliseconds timeout) {
  return std::string(error.what()) + (error.kind() == CommError::Kind::kTimeout ? timeoutExpired(timeout) : "");
}

} // namespace

void ProcessGroupTorus::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const auto timeout = opts.timeout == c10d::kUnsetTimeout ? timeout_.load() : opts.timeout;
  TORUS_CHECK_ARG(timeout.count() >= 0, "monitored_barrier timeout must not be negative, got ", timeout.count(),
                  " ms");
  const uint64_t call = monitoredBarriers_++;
  const uint64_t arrivalTag = kMonitoredBarrierTagBase + 2 * call;
  const uint64_t verdictTag = arrivalTag + 1;
  const std::string context = "torus:monitored_barrier #" + std::to_string(call + 1) + " (rank " +
                              std::to_string(rank_) + " of " + std::to_string(size_) + ", group '" + groupName_ + "')";
  failure_->throwIfFailed(context);

  if (rank_ != 0) {
    const std::string reached = "Rank " + std::to_string(rank_) +
                                " successfully reached monitoredBarrier, but received errors while waiting for "
                                "send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original "
                                "exception: \n" + context + ": ";
    auto arrival = std::make_shared<int64_t>(rank_);
    auto verdict = std::make_shared<Verdict>();
    const auto patience = timeout_.load() + timeout * (size_ - 1);
    try {
      RequestPtr sent = transport_->isend(0, arrivalTag, CallSignature{}, arrival.get(), sizeof(int64_t));
      sent->holdBuffer(arrival);
      RequestPtr answer = transport_->irecv(0, verdictTag, CallSignature{}, verdict->data(), sizeof(Verdict));
      answer->holdBuffer(verdict);
      transport_->wait({sent, answer}, Clock::now() + patience);
    } catch (const CommError& e) {
      raise(reached + describeFailure(e, patience));
    }
    const int64_t failed = (*verdict)[kFailedRanks];
    if (failed != 0) {
      raise(reached + "rank 0 found that rank " + std::to_string((*verdict)[kFirstFailedRank]) +
            (failed > 1 ? " and " + std::to_string(failed - 1) + " more" : std::string()) +
            " failed to pass monitoredBarrier");
    }
    return;
  }

  const auto start = Clock::now();
  const std::string within = " failed to pass monitoredBarrier in " + std::to_string(timeout.count()) + " ms";
  auto arrivals = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(size_));
  std::vector<RequestPtr> arrived(static_cast<size_t>(size_));
  for (int q = 1; q < size_; ++q) {
    arrived[q] = transport_->irecv(q, arrivalTag, CallSignature{}, &(*arrivals)[q], sizeof(int64_t));
    arrived[q]->holdBuffer(arrivals);
  }
  // Every other rank learns that the barrier failed; one that cannot be reached has failed already.
  auto fail = [&](const std::vector<int>& ranks, const std::string& what) {
    auto verdict = std::make_shared<Verdict>(Verdict{static_cast<int64_t>(ranks.size()), ranks.front()});
    for (int q = 1; q < size_; ++q) {
      try {
        transport_->isend(q, verdictTag, CallSignature{}, verdict->data(), sizeof(Verdict))->holdBuffer(verdict);
      } catch (const CommError&) {
        // That rank's connection is gone: it cannot be waiting for the verdict.
      }
    }
    raise(what);
  };

  std::vector<int> passed;
  std::vector<int> failed;
  std::string reasons;
  for (int q = 1; q < size_; ++q) {
    const Deadline deadline = waitAllRanks ? Clock::now() + timeout : start + timeout;
    if (!waitAllRanks && Clock::now() >= deadline) {
      std::vector<int> rest;
      for (int r = q; r < size_; ++r) {
        rest.push_back(r);
      }
      fail(rest, "Rank 0 timed out in monitoredBarrier after " + std::to_string(timeout.count()) + " ms.\n" +
                     (passed.empty() ? std::string("No ranks successfully processed in monitoredBarrier.")
                                     : "Successfully processed ranks: " + joined(passed)));
    }
    try {
      transport_->wait({arrived[q]}, deadline);
      passed.push_back(q);
    } catch (const CommError& e) {
      const std::string reason = context + ": " + describeFailure(e, timeout);
      if (!waitAllRanks) {
        fail({q}, "[Rank 0]: Rank " + std::to_string(q) + within + "\n Original exception: \n" + reason);
      }
      failed.push_back(q);
      reasons += "\n" + reason;
    }
  }
  if (!failed.empty()) {
    fail(failed, "[Rank 0]: Ranks " + joined(failed) + within + "\n Original exceptions: " + reasons);
  }
  auto verdict = std::make_shared<Verdict>(Verdict{0, -1});
  for (int q = 1; q < size_; ++q) {
    try {
      RequestPtr sent = transport_->isend(q, verdictTag, CallSignature{}, verdict->data(), sizeof(Verdict));
      sent->holdBuffer(verdict);
      transport_->wait({sent}, Clock::now() + timeout);
    } catch (const CommError& e) {
      fail({q}, "[Rank 0]: Rank " + std::to_string(q) + within + "\n Original exception: \n" + context + ": " +
                    describeFailure(e, timeout));
    }
  }
}

} // namespace torus
