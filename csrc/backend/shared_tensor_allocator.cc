#include "backend/shared_tensor_allocator.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

#include "transport/shm/shared_tensor_arena.h"

namespace torus {

namespace {

void releaseToArena(void* data) {
  SharedTensorArena::instance().release(data);
}

class SharedTensorAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (void* data = SharedTensorArena::instance().allocate(n)) {
      return {data, data, &releaseToArena, c10::Device(c10::DeviceType::CPU)};
    }
    return c10::GetCPUAllocator()->allocate(n);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

} // namespace

at::Tensor allocateSharedTensor(int64_t count, const at::TensorOptions& options) {
  TORCH_CHECK(count >= 0, "torus: allocate_tensor of ", count, " elements: the size must not be negative");
  if (!options.device().is_cpu()) {
    return at::empty({count}, options);
  }
  static SharedTensorAllocator allocator;
  return at::detail::empty_generic({count}, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

} // namespace torus
