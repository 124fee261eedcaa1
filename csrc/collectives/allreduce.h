// Every allreduce algorithm, for the backend to choose from per call.
#pragma once

#include <cstddef>

#include "comm/comm.h"
#include "reduce/reduce.h"

namespace torus {

// The signature every flat allreduce shares: in place, buf (count elements of
// reducer.elementSize) ends holding the reduction over all ranks of comm; staging comes from
// scratch, which must not overlap buf. torus_allreduce takes one for its column phase.
using AllreduceFn = void (*)(Comm&, void* buf, size_t count, const Reducer&, const Chunking&,
                             Scratch&);

} // namespace torus

// After AllreduceFn, which torus_allreduce.h needs whichever of the two is included first.
#include "collectives/direct_allreduce.h"
#include "collectives/rabenseifner_allreduce.h"
#include "collectives/recursive_doubling_allreduce.h"
#include "collectives/ring_allreduce.h"
#include "collectives/torus_allreduce.h"
#include "collectives/one_shot_allreduce.h"
#include "collectives/two_shot_allreduce.h"
