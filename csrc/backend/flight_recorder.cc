#include "backend/flight_recorder.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "backend/call_description.h"

namespace torus {

namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string quoted(const std::string& text) {
  std::ostringstream out;
  out << '"';
  for (const unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out << escaped;
    } else {
      out << c;
    }
  }
  out << '"';
  return out.str();
}

std::string shapes(const std::vector<std::vector<int64_t>>& all) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < all.size(); ++i) {
    out << (i ? ", [" : "[");
    for (size_t d = 0; d < all[i].size(); ++d) {
      out << (d ? ", " : "") << all[i][d];
    }
    out << ']';
  }
  out << ']';
  return out.str();
}

void copyShapes(const std::vector<at::Tensor>& tensors, std::vector<std::vector<int64_t>>& into) {
  into.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    into[i].assign(tensors[i].sizes().begin(), tensors[i].sizes().end());
  }
}

} // namespace

FlightRecorder::FlightRecorder(size_t capacity, std::string dir, int rank, int size, std::string groupName)
    : capacity_(capacity), dir_(std::move(dir)), rank_(rank), size_(size), groupName_(std::move(groupName)),
      ring_(capacity) {}

uint64_t FlightRecorder::record(const Call& call, const std::vector<at::Tensor>& inputs,
                                const std::vector<at::Tensor>& outputs) {
  if (!enabled()) {
    return 0;
  }
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = nextId_++;
  Entry& entry = ring_[id % capacity_];
  entry.id = id;
  entry.seq = 0;
  entry.call = call;
  copyShapes(inputs, entry.inputSizes);
  copyShapes(outputs, entry.outputSizes);
  entry.state = State::kScheduled;
  entry.createdNs = now;
  entry.startedNs = 0;
  entry.completedNs = 0;
  entry.error.clear();
  return id;
}

FlightRecorder::Entry* FlightRecorder::find(uint64_t id) {
  Entry& entry = ring_[id % capacity_];
  return entry.id == id ? &entry : nullptr;
}

void FlightRecorder::started(uint64_t id, uint64_t seq) {
  if (id == 0) {
    return;
  }
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(id)) {
    entry->seq = seq;
    entry->state = State::kStarted;
    entry->startedNs = now;
  }
}

void FlightRecorder::finished(uint64_t id, const std::string& error) {
  if (id == 0) {
    return;
  }
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(id)) {
    entry->state = error.empty() ? State::kCompleted : State::kFailed;
    entry->completedNs = now;
    entry->error = error;
  }
}

std::string FlightRecorder::dump(const std::string& reason, const std::string& waitingFor) {
  if (!enabled()) {
    return "";
  }
  static const char* const states[] = {"scheduled", "started", "completed", "failed"};
  std::ostringstream out;
  out << "{\n  \"version\": \"torus-1\",\n  \"pg_id\": " << quoted(groupName_) << ",\n  \"rank\": " << rank_
      << ",\n  \"world_size\": " << size_ << ",\n  \"dump_reason\": " << quoted(reason)
      << ",\n  \"time_dumped_ns\": " << nowNs() << ",\n  \"entries\": [";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t first = nextId_ > capacity_ ? nextId_ - capacity_ : 1;
    bool any = false;
    for (uint64_t id = first; id < nextId_; ++id) {
      const Entry* entry = find(id);
      if (entry == nullptr) {
        continue;
      }
      const Call& call = entry->call;
      out << (any ? ",\n" : "\n") << "    {\"record_id\": " << entry->id << ", \"pg_id\": " << quoted(groupName_)
          << ", \"collective_seq_id\": " << (call.p2p ? 0 : entry->seq)
          << ", \"p2p_seq_id\": " << (call.p2p ? entry->seq : 0)
          << ", \"profiling_name\": " << quoted(call.profilingName) << ", \"is_p2p\": " << (call.p2p ? "true" : "false")
          << ", \"input_sizes\": " << shapes(entry->inputSizes) << ", \"output_sizes\": " << shapes(entry->outputSizes)
          << ", \"input_dtypes\": [" << quoted(c10::toString(call.dtype)) << "], \"output_dtypes\": ["
          << quoted(c10::toString(call.dtype)) << "]"
          << ", \"root_or_peer\": " << call.rootOrPeer
          << ", \"issued_by\": " << quoted(call.fromCallback ? "callback" : "caller")
          << ", \"state\": " << quoted(states[static_cast<int>(entry->state)])
          << ", \"time_created_ns\": " << entry->createdNs
          << ", \"time_discovered_started_ns\": " << (entry->startedNs ? std::to_string(entry->startedNs) : "null")
          << ", \"time_discovered_completed_ns\": "
          << (entry->completedNs ? std::to_string(entry->completedNs) : "null")
          << ", \"error\": " << quoted(entry->error) << ", \"waiting_for\": "
          << quoted(entry->state == State::kStarted && !call.p2p ? waitingFor : "") << "}";
      any = true;
    }
  }
  out << "\n  ]\n}\n";
  const std::string path = dir_ + "/rank" + std::to_string(rank_) + ".json";
  std::error_code failed;
  std::filesystem::create_directories(dir_, failed);
  std::ofstream file(path + ".tmp");
  file << out.str();
  file.close();
  if (failed || !file || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "[torus rank %d] cannot write the flight recorder's dump to %s\n", rank_, path.c_str());
    return "";
  }
  return path;
}

} // namespace torus
