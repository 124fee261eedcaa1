// all_reduce of a sparse COO tensor (SUM), computed as gloo computes it, so that the results
// agree bit for bit: every rank's coalesced indices and values gathered to every rank, then
// summed there in rank order and coalesced.
//
// n ranks; rank q holds nnz_q non-zeros of its tensor, which has d dims, s of them sparse, and v
// bytes of values per non-zero (the dense dims' elements times the element size):
//   1. allgather of a header of 4 int64 per rank (nnz, sparse dims, dense dims, dims): every rank
//      checks that the tensors agree in their dims.                           32(n-1) bytes in
//   2. allgather of each rank's sizes and indices, int64: every rank checks the sizes.
//                                                               sum over q != r of 8(d + s·nnz_q) in
//   3. allgather of each rank's values.                         sum over q != r of v·nnz_q bytes in
//   4. locally: rank 0's indices and values as a sparse tensor, each other rank's added in rank
//      order, coalesced (indices sorted, duplicates summed); the tensor takes the result in place.
//      float16 and bool, which torch's sparse add does not take on the CPU, are coalesced at once
//      from every rank's entries in rank order.
// Each allgather runs with the group's allgather algorithm for its size, its blocks uneven.
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/accumulate.h>

#include "backend/call_description.h"
#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"

namespace torus {

namespace {

// The header every rank contributes first.
enum HeaderField : int64_t { kNonZeros, kSparseDims, kDenseDims, kDims, kHeaderFields };

at::Tensor int64Tensor(const std::vector<int64_t>& values) {
  return at::tensor(values, at::kLong);
}

std::string shapeOf(const at::Tensor& header, int rank) {
  const auto* field = header.data_ptr<int64_t>() + static_cast<int64_t>(rank) * kHeaderFields;
  return std::to_string(field[kDims]) + " dims (" + std::to_string(field[kSparseDims]) + " sparse, " +
         std::to_string(field[kDenseDims]) + " dense)";
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::allreduceSparse(at::Tensor& tensor,
                                                                  const c10d::AllreduceOptions& opts) {
  TORUS_CHECK_ARG(tensor.device().is_cpu(), "all_reduce tensor is a sparse tensor on ", tensor.device(),
                  "; sparse tensors are all-reduced on the CPU (move it there with .cpu())");
  TORUS_CHECK_ARG(opts.reduceOp.op_ == c10d::ReduceOp::SUM, "all_reduce of a sparse tensor supports ReduceOp.SUM "
                  "only, got ReduceOp.", reduceOpName(opts.reduceOp.op_));
  // The byte count differs by rank (each holds its own non-zeros): the call's messages carry 0.
  const CallDescription call{c10d::OpType::ALLREDUCE, tensor.scalar_type(), 0, opts.reduceOp.op_};
  return submit(call, {tensor}, {tensor}, opts, [this, tensor](Comm& comm, DeviceCall*) mutable {
    // As gloo: below autograd, so that a tensor that requires grad takes its result in place.
    at::AutoDispatchBelowAutograd belowAutograd;
    const at::Tensor input = tensor.coalesce();
    const int n = comm.size();
    const int rank = comm.rank();
    const int64_t sparseDims = input.sparse_dim();
    const int64_t dims = input.dim();

    const at::Tensor header = allgatherBlocks(
        comm, int64Tensor({input._nnz(), sparseDims, input.dense_dim(), dims}),
        std::vector<size_t>(static_cast<size_t>(n), kHeaderFields));
    const auto* headers = header.data_ptr<int64_t>();
    std::vector<size_t> shapeAndIndexCounts(static_cast<size_t>(n));
    std::vector<size_t> valueCounts(static_cast<size_t>(n));
    const int64_t denseElements = c10::multiply_integers(input.sizes().slice(static_cast<size_t>(sparseDims)));
    for (int q = 0; q < n; ++q) {
      const int64_t* theirs = headers + static_cast<int64_t>(q) * kHeaderFields;
      TORUS_CHECK_ARG(theirs[kSparseDims] == sparseDims && theirs[kDenseDims] == input.dense_dim() &&
                          theirs[kDims] == dims,
                      "all_reduce of sparse tensors needs the same shape on every rank: rank ", q, "'s tensor has ",
                      shapeOf(header, q), ", rank ", rank, "'s has ", shapeOf(header, rank));
      shapeAndIndexCounts[q] = static_cast<size_t>(dims + sparseDims * theirs[kNonZeros]);
      valueCounts[q] = static_cast<size_t>(denseElements * theirs[kNonZeros]);
    }

    const at::Tensor shapesAndIndices = allgatherBlocks(
        comm, at::cat({int64Tensor(input.sizes().vec()), input._indices().reshape({-1})}), shapeAndIndexCounts);
    const at::Tensor values = allgatherBlocks(comm, input._values().contiguous().reshape({-1}), valueCounts);

    std::vector<int64_t> denseShape = input._values().sizes().vec();
    std::vector<at::Tensor> indices;
    std::vector<at::Tensor> parts;
    int64_t shapeOffset = 0;
    int64_t valueOffset = 0;
    for (int q = 0; q < n; ++q) {
      const int64_t nonZeros = headers[static_cast<int64_t>(q) * kHeaderFields + kNonZeros];
      const int64_t* theirSizes = shapesAndIndices.data_ptr<int64_t>() + shapeOffset;
      const c10::IntArrayRef sizes(theirSizes, static_cast<size_t>(dims));
      TORUS_CHECK_ARG(sizes == input.sizes(), "all_reduce of sparse tensors needs the same size on every rank: rank ",
                      q, "'s tensor has size ", sizes, ", rank ", rank, "'s has ", input.sizes());
      denseShape[0] = nonZeros;
      indices.push_back(
          shapesAndIndices.narrow(0, shapeOffset + dims, sparseDims * nonZeros).view({sparseDims, nonZeros}));
      parts.push_back(values.narrow(0, valueOffset, denseElements * nonZeros).view(denseShape));
      shapeOffset += static_cast<int64_t>(shapeAndIndexCounts[q]);
      valueOffset += static_cast<int64_t>(valueCounts[q]);
    }
    at::Tensor sum;
    if (input.scalar_type() == at::kHalf || input.scalar_type() == at::kBool) {
      // torch's sparse add has no CPU kernel for these (gloo fails there): every rank's entries
      // go into one tensor, whose coalesce sums them.
      sum = at::sparse_coo_tensor(at::cat(indices, 1), at::cat(parts), input.sizes(), input.options());
    } else {
      // The sum grows in place from rank 0's part, so that part gets memory of its own: the
      // others' parts are views of the same gathered buffers.
      sum = at::sparse_coo_tensor(indices[0].clone(), parts[0].clone(), input.sizes(), input.options());
      for (int q = 1; q < n; ++q) {
        sum.add_(at::sparse_coo_tensor(indices[q], parts[q], input.sizes(), input.options()));
      }
    }
    tensor.copy_(sum.coalesce());
  });
}

} // namespace torus
