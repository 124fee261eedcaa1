// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the proofs that a connection's peer knows
// its group's secret (transport/group_secret.h). Written here rather than linked from libcrypto:
// a hello or two per connection need no fast hash, and the project adds no dependency for them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace torus {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Digest finish();

 private:
  void block(const uint8_t* p);

  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t length_ = 0; // bytes hashed, in all
};

// HMAC-SHA256 of `message` under `key`.
Digest hmacSha256(const std::string& key, const std::string& message);

// Whether two digests are equal, in a time that does not depend on where they differ.
bool sameDigest(const Digest& a, const Digest& b);

} // namespace torus
