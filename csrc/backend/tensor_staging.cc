#include "backend/tensor_staging.h"

#include <cstring>

namespace torus {

size_t bytesOf(const at::Tensor& tensor) {
  return static_cast<size_t>(tensor.numel()) * tensor.element_size();
}

size_t totalBytesOf(const std::vector<at::Tensor>& tensors) {
  size_t total = 0;
  for (const auto& t : tensors) {
    total += bytesOf(t);
  }
  return total;
}

at::Tensor contiguousBuffer(const at::Tensor& tensor) {
  return tensor.is_contiguous() ? tensor : tensor.contiguous();
}

void writeBack(at::Tensor& tensor, const at::Tensor& buffer) {
  if (!tensor.is_same(buffer)) {
    tensor.copy_(buffer.view(tensor.sizes()));
  }
}

Blocks blocksOfCounts(const std::vector<size_t>& counts) {
  Blocks blocks;
  size_t offset = 0;
  for (size_t count : counts) {
    blocks.offsets.push_back(offset);
    blocks.counts.push_back(count);
    offset += count;
  }
  return blocks;
}

Blocks equalBlocks(size_t count, int n) {
  return blocksOfCounts(std::vector<size_t>(static_cast<size_t>(n), count));
}

at::Tensor packBytes(const std::vector<at::Tensor>& tensors) {
  auto packed = at::empty({static_cast<int64_t>(totalBytesOf(tensors))}, at::kByte);
  int64_t offset = 0;
  for (const auto& t : tensors) {
    auto n = static_cast<int64_t>(bytesOf(t));
    if (n > 0) {
      std::memcpy(static_cast<char*>(packed.data_ptr()) + offset, contiguousBuffer(t).data_ptr(), n);
    }
    offset += n;
  }
  return packed;
}

void unpackBytes(at::Tensor& tensor, const at::Tensor& bytes) {
  if (tensor.numel() == 0) {
    return;
  }
  tensor.copy_(bytes.view(tensor.scalar_type()).view(tensor.sizes()));
}

at::Tensor concatenated(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
}

} // namespace torus
