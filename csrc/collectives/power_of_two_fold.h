// The fold that lets power-of-two algorithms (recursive doubling, Rabenseifner) run on any
// number of ranks.
#pragma once

#include <cstddef>
#include <functional>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// In place, as an allreduce: n ranks are folded onto p, the largest power of two <= n, then
// `allreduce` runs on a Comm of those p ranks, then the result is unfolded. Of the first 2(n-p)
// ranks, each odd one sends buf to the even one before it, which reduces it into its own and
// joins the p; after `allreduce` the even one sends the result back. The other ranks join the p
// as they are. Costs 2 extra steps and S bytes each way on the folded pairs when n is not a power
// of two. Staging comes from scratch, which must not overlap buf; `allreduce` may use it too.
void allreduceFolded(Comm& comm, void* buf, size_t count, const Reducer& reducer,
                     const Chunking& chunking, Scratch& scratch,
                     const std::function<void(Comm& powerOfTwo)>& allreduce);

} // namespace torus
