// How entry points stage tensors for the collectives, which work on contiguous raw buffers:
// contiguous stand-ins written back afterwards, and several tensors packed into one byte buffer.
#pragma once

#include <cstddef>
#include <vector>

#include <ATen/ATen.h>

#include "collectives/blocks.h"

namespace torus {

size_t bytesOf(const at::Tensor& tensor);
size_t totalBytesOf(const std::vector<at::Tensor>& tensors);
// The tensor itself when contiguous, else a contiguous copy (written back by writeBack).
at::Tensor contiguousBuffer(const at::Tensor& tensor);
// Copies `buffer` into `tensor` unless it is the tensor itself.
void writeBack(at::Tensor& tensor, const at::Tensor& buffer);
// Consecutive blocks of the given element counts.
Blocks blocksOfCounts(const std::vector<size_t>& counts);
// `n` blocks of `count` elements each.
Blocks equalBlocks(size_t count, int n);
// The tensors' bytes back to back, as one uint8 tensor.
at::Tensor packBytes(const std::vector<at::Tensor>& tensors);
// Copies `bytes` (a uint8 view) into `tensor`, whatever its dtype and strides.
void unpackBytes(at::Tensor& tensor, const at::Tensor& bytes);
// The tensors flattened and concatenated, as one new contiguous tensor.
at::Tensor concatenated(const std::vector<at::Tensor>& tensors);

} // namespace torus
