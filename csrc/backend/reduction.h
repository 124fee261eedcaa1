// Reduction: one torch reduce op as the collectives see it (a Reducer), plus the element-wise
// work torch's ops add around the combining step: PREMUL_SUM multiplies before, AVG divides after.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "comm/device_path.h"
#include "reduce/reduce.h"

namespace torus {

struct Reduction {
  Reducer reducer;
  // The same dtype and op, as the device kernels take them.
  DeviceReduction onDevice{DataType::kFloat32, ReduceKind::kSum};
  double preScale = 1.0;
  bool average = false;

  // Raises naming `collective` when torch's op has no reducer for dtype.
  static Reduction of(const c10d::ReduceOp& op, at::ScalarType dtype, const char* collective);

  // Before the collective: PREMUL_SUM's factor, on the buffer the collective reduces (torch's
  // mul_, so a device buffer is scaled on the current stream, as finish divides).
  void prepare(at::Tensor& buffer) const;
  // After it: AVG's division over `worldSize` ranks on `result` (this rank's part of the reduced
  // buffer), then `result` written into `output` unless it is that tensor itself.
  void finish(at::Tensor& result, at::Tensor& output, int worldSize) const;
};

} // namespace torus
