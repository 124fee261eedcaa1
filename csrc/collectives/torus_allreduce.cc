// 2D-torus allreduce (Mikami et al. 2018), n = r x c ranks, S bytes: reduce-scatter along the
// rows, allreduce of each rank's 1/c shard along the columns with an inner algorithm, allgather
// along the rows, each phase a call on a row or column Comm (ring_reduce_scatter, inner,
// ring_allgather).
//
// Steps: 2(c-1) + 2(r-1) with the ring as inner (2(c-1) + the inner's steps on r ranks
// otherwise), against the ring's 2(n-1): at 32 x 32, 124 against 2046.
// Bytes sent per rank: S(c-1)/c on the row each way, plus the inner's on S/c: 2S(c-1)/c +
// 2(S/c)(r-1)/r = 2S(n-1)/n with a bandwidth-optimal inner, the ring's. When rows are the ranks of
// one host, the column phase is the only traffic between hosts and carries S/c per rank.
// Pipelining: buf is cut into segments of c x kChunksInFlight x chunkBytes, so that each rank's
// row block of a segment is exactly the ring's window of kChunksInFlight full chunks, and its
// column shard as many: every message is full-sized, each phase pipelines its chunks at full
// depth, and segments stay large enough that the 2(c-1) + 2(r-1) step latencies a segment pays
// again are small against its transfer time, while a large buffer still makes many segments. The
// column phase of segment k runs on a second thread while this one runs the row phases of the
// segments around it (reduce-scatter of k+1, allgather of k-1), so row and column links are busy
// together. Row and column Comms share the tag; a row peer is never a column peer, so their
// messages never mix. With a single segment, or a grid with one row or one column (nothing to
// overlap), everything runs on the calling thread. A failure of the row phases ends the whole
// collective (Comm::fail) before the column thread is joined.
//
// Rows on shared memory: a row whose ranks share memory with single-copy access (a row on one
// host) runs its phases as two_shot does, by single copies under one posting per segment:
// single_copy_reduce_scatter's reduction, the column phase, single_copy_allgather's transfer,
// then one delivery to every row peer. 2 synchronizations per segment in all, against 2(c-1)
// message steps (and 4 for the two algorithms called one after the other), the same bytes
// copied. Safe without more: a rank reads and writes only its own block of its row peers'
// buffers, its column phase touches only its own block of its own buffer, which no row peer
// reads or writes, and a peer's delivery comes after its last read and write of this rank's
// buffer. Measured against message rows in BENCHMARKS.md.
#include "collectives/torus_allreduce.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "collectives/blocks.h"
#include "collectives/ring_allgather.h"
#include "collectives/ring_reduce_scatter.h"
#include "collectives/shm_posting.h"
#include "collectives/single_copy_allgather.h"
#include "collectives/single_copy_reduce_scatter.h"

namespace torus {

GridLines linesThrough(const TorusGrid& grid, int size, int rank) {
  const size_t columns = grid.rows.empty() ? 0 : grid.rows.front().size();
  std::vector<int> seen(static_cast<size_t>(size), 0);
  GridLines lines;
  for (const std::vector<int>& row : grid.rows) {
    if (row.size() != columns) {
      throw std::invalid_argument("torus grid rows differ in length");
    }
    for (size_t j = 0; j < columns; ++j) {
      if (row[j] < 0 || row[j] >= size || seen[row[j]]++ > 0) {
        throw std::invalid_argument("torus grid names rank " + std::to_string(row[j]) +
                                    " twice or outside a group of " + std::to_string(size));
      }
      if (row[j] == rank) {
        lines.row = row;
        for (const std::vector<int>& other : grid.rows) {
          lines.column.push_back(other[j]);
        }
      }
    }
  }
  if (grid.rows.size() * columns != static_cast<size_t>(size)) {
    throw std::invalid_argument("torus grid of " + std::to_string(grid.rows.size()) + " x " +
                                std::to_string(columns) + " does not fit a group of " +
                                std::to_string(size));
  }
  return lines;
}

namespace {

// Runs the column phase of segments 0, 1, ... in order on a thread of its own, each once the row
// phase has handed it over, with scratch of its own. Destruction stops it after the segment in
// progress and joins it, so the caller joins on every path, exceptions included.
class ColumnThread {
 public:
  using Phase = std::function<void(size_t segment, Scratch& scratch)>;

  ColumnThread(size_t segments, Phase phase)
      : segments_(segments), phase_(std::move(phase)), thread_([this] { run(); }) {}

  ~ColumnThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  ColumnThread(const ColumnThread&) = delete;
  ColumnThread& operator=(const ColumnThread&) = delete;

  // Segment `segment`, the next in order, is ready for its column phase.
  void handOver(size_t segment) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      handedOver_ = segment + 1;
    }
    changed_.notify_all();
  }

  // Returns once the column phase of `segment` is done; rethrows what the thread threw.
  void awaitDone(size_t segment) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_ > segment || error_; });
    if (done_ <= segment) {
      std::rethrow_exception(error_);
    }
  }

 private:
  void run() {
    for (size_t segment = 0; segment < segments_; ++segment) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return handedOver_ > segment || stopping_; });
        if (stopping_) {
          return;
        }
      }
      try {
        phase_(segment, scratch_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        changed_.notify_all();
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        done_ = segment + 1;
      }
      changed_.notify_all();
    }
  }

  const size_t segments_;
  const Phase phase_;
  Scratch scratch_;
  std::mutex mutex_;
  std::condition_variable changed_;
  size_t handedOver_ = 0;
  size_t done_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  // Last: the thread starts once every member above is ready.
  std::thread thread_;
};

} // namespace

void torus_allreduce(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                     const TorusGrid& grid, AllreduceFn inner, const Chunking& chunking,
                     Scratch& scratch) {
  const GridLines lines = linesThrough(grid, comm.size(), comm.rank());
  Comm row = comm.subset(lines.row);
  Comm column = comm.subset(lines.column);
  const size_t elementSize = reducer.elementSize;
  const bool overlap = row.size() > 1 && column.size() > 1;
  const size_t segmentElements =
      overlap ? row.size() * kChunksInFlight * chunkElements(chunking, elementSize) : count;
  const size_t segments = count == 0 ? 0 : (count + segmentElements - 1) / segmentElements;

  char* bytes = static_cast<char*>(buf);
  const auto segmentData = [&](size_t segment) {
    return bytes + segment * segmentElements * elementSize;
  };
  const auto segmentCount = [&](size_t segment) {
    return std::min(segmentElements, count - segment * segmentElements);
  };
  const auto segmentBlocks = [&](size_t segment) {
    return evenBlocks(segmentCount(segment), row.size());
  };
  // The same on every rank of the row, as Comm::sharedMemory() is.
  SharedMemory* rowMemory =
      row.sharedMemory() != nullptr && row.sharedMemory()->singleCopy() ? row.sharedMemory() : nullptr;
  // Each segment's row postings, from its reduce-scatter to its allgather.
  std::vector<std::vector<SharedMemory::Posting>> rowPostings(rowMemory != nullptr ? segments : 0);
  const auto reduceScatterRow = [&](size_t segment) {
    if (rowMemory != nullptr) {
      rowPostings[segment] = postAndGather(row, *rowMemory, rowMemory->beginCollective(), segmentData(segment),
                                           segmentCount(segment) * elementSize);
      reduceOwnBlockFromPeers(row, *rowMemory, rowPostings[segment], segmentData(segment), segmentBlocks(segment),
                              reducer, scratch, nullptr);
    } else {
      ring_reduce_scatter(row, segmentData(segment), segmentBlocks(segment), reducer, chunking,
                          scratch);
    }
  };
  const auto allreduceColumn = [&](size_t segment, Scratch& columnScratch) {
    const Blocks blocks = segmentBlocks(segment);
    inner(column, segmentData(segment) + blocks.offsets[row.rank()] * elementSize,
          blocks.counts[row.rank()], reducer, chunking, columnScratch);
  };
  const auto allgatherRow = [&](size_t segment) {
    if (rowMemory != nullptr) {
      const Blocks blocks = segmentBlocks(segment);
      writeToPeers(row, *rowMemory, rowPostings[segment], segmentData(segment),
                   Chunk{blocks.offsets[row.rank()], blocks.counts[row.rank()]}, elementSize);
      finishWithPeers(row, *rowMemory);
    } else {
      ring_allgather(row, segmentData(segment), segmentBlocks(segment), elementSize, chunking);
    }
  };

  if (segments < 2) {
    for (size_t segment = 0; segment < segments; ++segment) {
      reduceScatterRow(segment);
      allreduceColumn(segment, scratch);
      allgatherRow(segment);
    }
    return;
  }
  // Each rank of a row runs its row phases in this same order, and each rank of a column its
  // column phases, so every Comm sees the same sequence of calls on all its ranks.
  ColumnThread columnThread(segments, allreduceColumn);
  try {
    reduceScatterRow(0);
    columnThread.handOver(0);
    for (size_t segment = 1; segment < segments; ++segment) {
      reduceScatterRow(segment);
      columnThread.handOver(segment);
      columnThread.awaitDone(segment - 1);
      allgatherRow(segment - 1);
    }
    columnThread.awaitDone(segments - 1);
    allgatherRow(segments - 1);
  } catch (...) {
    // The column thread may wait on column peers that wait, through their rows, on this rank:
    // the collective ends (and its peers learn why) before the thread is joined, not after the
    // column phase has waited out the timeout.
    comm.fail(std::current_exception());
    throw;
  }
}

} // namespace torus
