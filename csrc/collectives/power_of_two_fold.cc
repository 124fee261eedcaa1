#include "collectives/power_of_two_fold.h"

#include <cstdint>
#include <vector>

#include "collectives/partner_exchange.h"

namespace torus {

void allreduceFolded(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                     const Chunking& chunking, Scratch& scratch,
                     const std::function<void(Comm& powerOfTwo)>& allreduce) {
  const int n = comm.size();
  const int rank = comm.rank();
  int64_t p = 1;
  while (p * 2 <= n) {
    p *= 2;
  }
  const int pairs = n - static_cast<int>(p);
  const ElementRange whole{0, count};
  const ElementRange nothing{};

  if (rank < 2 * pairs && rank % 2 == 1) {
    exchangeCopy(comm, rank - 1, buf, whole, nothing, reducer.elementSize, chunking);
    exchangeCopy(comm, rank - 1, buf, nothing, whole, reducer.elementSize, chunking);
    return;
  }
  if (rank < 2 * pairs) {
    exchangeReduce(comm, rank + 1, buf, nothing, whole, reducer, chunking, scratch);
  }
  // Rank i of the p: the even rank of pair i, then the ranks that were not paired.
  std::vector<int> remaining(static_cast<size_t>(p));
  for (int i = 0; i < p; ++i) {
    remaining[i] = i < pairs ? 2 * i : i + pairs;
  }
  Comm powerOfTwo = comm.subset(remaining);
  allreduce(powerOfTwo);
  if (rank < 2 * pairs) {
    exchangeCopy(comm, rank + 1, buf, whole, nothing, reducer.elementSize, chunking);
  }
}

} // namespace torus
