#include "backend/reduction.h"

#include "backend/call_description.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"

namespace torus {

Reduction Reduction::of(const c10d::ReduceOp& op, at::ScalarType dtype, const char* collective) {
  const DataType dataType = toDataType(dtype, std::string(collective) + " tensor");
  const bool floating = isFloatingPoint(dataType);
  Reduction reduction;
  ReduceKind kind = ReduceKind::kSum;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      break;
    case c10d::ReduceOp::AVG:
      TORUS_CHECK(floating, "ReduceOp.AVG in ", collective, " needs a floating-point tensor, got ", dtype);
      reduction.average = true;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORUS_CHECK(floating, "ReduceOp.PREMUL_SUM in ", collective, " needs a floating-point tensor, got ", dtype);
      // NCCLPreMulSumSupplement: the struct's name up to torch 2.11, kept as an alias of
      // PreMulSumSupplement since; the one name that builds against both.
      auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORUS_CHECK(supplement != nullptr, "ReduceOp.PREMUL_SUM in ", collective, " carries no factor");
      reduction.preScale =
          supplement->tensor_factor.defined() ? supplement->tensor_factor.item<double>() : supplement->double_factor;
      break;
    }
    case c10d::ReduceOp::PRODUCT:
      kind = ReduceKind::kProduct;
      break;
    case c10d::ReduceOp::MIN:
      kind = ReduceKind::kMin;
      break;
    case c10d::ReduceOp::MAX:
      kind = ReduceKind::kMax;
      break;
    case c10d::ReduceOp::BAND:
      kind = ReduceKind::kBand;
      break;
    case c10d::ReduceOp::BOR:
      kind = ReduceKind::kBor;
      break;
    case c10d::ReduceOp::BXOR:
      kind = ReduceKind::kBxor;
      break;
    default:
      TORUS_CHECK(false, "reduce op ", reduceOpName(op.op_), " is not supported (", collective, ")");
  }
  reduction.reducer = makeReducer(dataType, kind);
  reduction.onDevice = DeviceReduction{dataType, kind};
  TORUS_CHECK(reduction.reducer.fn != nullptr, "ReduceOp.", reduceOpName(op.op_), " is not supported for ", dtype,
              " tensors (", collective, ")");
  return reduction;
}

void Reduction::prepare(at::Tensor& buffer) const {
  if (preScale != 1.0) {
    buffer.mul_(preScale);
  }
}

void Reduction::finish(at::Tensor& result, at::Tensor& output, int worldSize) const {
  if (average) {
    result.div_(worldSize);
  }
  writeBack(output, result);
}

} // namespace torus
