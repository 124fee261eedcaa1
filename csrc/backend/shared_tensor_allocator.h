// The backend's tensor allocation hook (c10d's allocate_tensor): CPU tensors in memory that this
// host's peers map (SharedTensorArena), so that shared-memory collectives read and write them with
// plain loads and stores instead of copies through the kernel. Tensors too small for a segment,
// tensors of other devices, and any the system refuses a segment for come from torch's own
// allocators: they work the same, through the copies.
#pragma once

#include <ATen/ATen.h>

namespace torus {

// A tensor of `count` elements as at::empty({count}, options) gives.
at::Tensor allocateSharedTensor(int64_t count, const at::TensorOptions& options);

} // namespace torus
