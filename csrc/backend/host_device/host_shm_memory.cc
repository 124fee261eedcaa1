#include "backend/host_device/host_shm_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

namespace torus {

namespace {

class HostShmMemory : public ArenaMemory {
 public:
  ~HostShmMemory() override {
    exchanged();
    for (auto& [mapping, bytes] : mappings_) {
      munmap(mapping, bytes);
    }
  }

  std::string deviceName() const override {
    return "the host device";
  }

  char* allocate(size_t bytes, ArenaHandle& handle, std::string& why) override {
    std::random_device random;
    std::ostringstream name;
    name << "/torus-arena-" << getpid() << "-" << std::hex << random() << random();
    if (name.str().size() >= sizeof(handle.bytes)) {
      why = "the segment name " + name.str() + " is too long";
      return nullptr;
    }
    const int fd = shm_open(name.str().c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      why = "shm_open(" + name.str() + "): " + std::strerror(errno);
      return nullptr;
    }
    ownName_ = name.str();
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      why = "ftruncate(" + ownName_ + "): " + std::strerror(errno);
      close(fd);
      return nullptr;
    }
    char* own = mapAndClose(fd, bytes, why);
    if (own != nullptr) {
      std::memset(own, 0xff, bytes);
      std::memset(handle.bytes, 0, sizeof(handle.bytes));
      std::memcpy(handle.bytes, ownName_.c_str(), ownName_.size());
    }
    return own;
  }

  char* open(const ArenaHandle& handle, int rank, size_t bytes, std::string& why) override {
    const std::string name(handle.bytes, strnlen(handle.bytes, sizeof(handle.bytes)));
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      why = "shm_open(" + name + "): " + std::strerror(errno);
      return nullptr;
    }
    return mapAndClose(fd, bytes, why);
  }

  void exchanged() override {
    if (!ownName_.empty()) {
      shm_unlink(ownName_.c_str());
      ownName_.clear();
    }
  }

 private:
  char* mapAndClose(int fd, size_t bytes, std::string& why) {
    void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int error = errno;
    close(fd);
    if (mapped == MAP_FAILED) {
      why = std::string("mmap: ") + std::strerror(error);
      return nullptr;
    }
    mappings_.emplace_back(static_cast<char*>(mapped), bytes);
    return static_cast<char*>(mapped);
  }

  std::string ownName_; // until unlinked
  std::vector<std::pair<char*, size_t>> mappings_;
};

} // namespace

std::unique_ptr<ArenaMemory> makeHostShmMemory() {
  return std::make_unique<HostShmMemory>();
}

} // namespace torus
