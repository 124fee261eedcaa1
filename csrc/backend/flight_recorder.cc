#include "backend/flight_recorder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>
#include <thread>

namespace torus {

namespace {

constexpr uint64_t kSpilled = uint64_t{1} << 40;
constexpr uint64_t kStateShift = 10;
constexpr uint64_t kStateMask = uint64_t{3} << kStateShift;
// How often the dump tries to copy an entry that a writer holds before it leaves it out.
constexpr int kSnapshotTries = 1000;

uint64_t packCall(const FlightRecorder::Call& call) {
  return static_cast<uint64_t>(static_cast<uint8_t>(call.dtype)) | (call.p2p ? uint64_t{1} << 8 : 0) |
         (call.fromCallback ? uint64_t{1} << 9 : 0) |
         (static_cast<uint64_t>(static_cast<uint32_t>(call.rootOrPeer)) << 32);
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

std::vector<std::vector<int64_t>> shapesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<int64_t>> all;
  for (const at::Tensor& tensor : tensors) {
    all.push_back(tensor.sizes().vec());
  }
  return all;
}

std::atomic<FlightRecorder::StackProvider> stackProvider{nullptr};
thread_local const std::string* presetStacks = nullptr;

// Makes `path` a directory of this user's, created 0700 if absent; the reason when it cannot be
// one (another user's, a link, a file), else empty.
std::string ownDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) == 0) {
    return "";
  }
  if (errno != EEXIST) {
    return "cannot create " + path + ": " + std::strerror(errno);
  }
  struct stat info{};
  if (::lstat(path.c_str(), &info) != 0) {
    return "cannot inspect " + path + ": " + std::strerror(errno);
  }
  if (!S_ISDIR(info.st_mode)) {
    return path + " is not a directory (a link or a file is never followed)";
  }
  if (info.st_uid != ::geteuid()) {
    return path + " belongs to uid " + std::to_string(info.st_uid) + ", not to this user (uid " +
           std::to_string(::geteuid()) + ")";
  }
  return "";
}

// Writes `text` to a new file `path` (never through a link, never over an existing file).
std::string writeNewFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return "cannot create " + path + ": " + std::strerror(errno);
  }
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(path.c_str());
      return "cannot write " + path + ": " + why;
    }
    written += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    ::unlink(path.c_str());
    return "cannot write " + path + ": " + std::strerror(errno);
  }
  return "";
}

// Keeps the last `capacity` of `items`.
template <typename T>
void keepLast(std::deque<T>& items, size_t capacity) {
  while (items.size() > capacity) {
    items.pop_front();
  }
}

} // namespace

FlightRecorder::FlightRecorder(size_t capacity, std::string dir, int rank, int size, std::string groupName)
    : capacity_(capacity), dir_(std::move(dir)), rank_(rank), size_(size), groupName_(std::move(groupName)),
      ring_(capacity ? new Entry[capacity] : nullptr),
      clock_(capacity ? std::make_unique<c10::ApproximateClockToUnixTimeConverter>() : nullptr) {}

uint64_t FlightRecorder::acquire(Entry& entry) {
  uint64_t version = entry.version.load(std::memory_order_relaxed);
  for (;;) {
    if ((version & 1) == 0 && entry.version.compare_exchange_weak(version, version + 1, std::memory_order_acquire,
                                                                  std::memory_order_relaxed)) {
      // The fields written next are not seen before the odd version.
      std::atomic_thread_fence(std::memory_order_release);
      return version + 1;
    }
    if (version & 1) {
      std::this_thread::yield();
      version = entry.version.load(std::memory_order_relaxed);
    }
  }
}

void FlightRecorder::release(Entry& entry, uint64_t version) {
  entry.version.store(version + 1, std::memory_order_release);
}

bool FlightRecorder::storeInline(const std::vector<at::Tensor>& tensors, InlineShapes& into) {
  if (tensors.size() > kInlineTensors) {
    return false;
  }
  uint64_t ranks = 0;
  size_t d = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto sizes = tensors[i].sizes();
    if (d + sizes.size() > kInlineDims) {
      return false;
    }
    ranks |= static_cast<uint64_t>(sizes.size()) << (4 * i);
    for (const int64_t s : sizes) {
      if (s > std::numeric_limits<int32_t>::max()) {
        return false;
      }
      into.dims[d++].store(static_cast<int32_t>(s), std::memory_order_relaxed);
    }
  }
  into.layout.store(tensors.size() | ranks << 8, std::memory_order_relaxed);
  return true;
}

std::vector<std::vector<int64_t>> FlightRecorder::loadInline(const InlineShapes& from) {
  const uint64_t layout = from.layout.load(std::memory_order_relaxed);
  std::vector<std::vector<int64_t>> all(layout & 0xff);
  size_t d = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const size_t rank = (layout >> (8 + 4 * i)) & 0xf;
    for (size_t k = 0; k < rank && d < kInlineDims; ++k) {
      all[i].push_back(from.dims[d++].load(std::memory_order_relaxed));
    }
  }
  return all;
}

uint64_t FlightRecorder::record(const Call& call, const std::vector<at::Tensor>& inputs,
                                const std::vector<at::Tensor>& outputs, uint64_t startedAs) {
  if (!enabled()) {
    return 0;
  }
  const uint64_t now = static_cast<uint64_t>(c10::getApproximateTime());
  const uint64_t id = nextId_.fetch_add(1, std::memory_order_relaxed);
  Entry& entry = ring_[id % capacity_];
  const uint64_t version = acquire(entry);
  entry.id.store(id, std::memory_order_relaxed);
  const State state = startedAs != 0 ? State::kStarted : State::kScheduled;
  entry.seq.store(startedAs, std::memory_order_relaxed);
  entry.title.store(call.profilingName, std::memory_order_relaxed);
  entry.call.store(packCall(call) | static_cast<uint64_t>(state) << kStateShift, std::memory_order_relaxed);
  entry.created.store(now, std::memory_order_relaxed);
  entry.started.store(startedAs != 0 ? now : 0, std::memory_order_relaxed);
  entry.completed.store(0, std::memory_order_relaxed);
  entry.reduceOp.store(call.reduceOp, std::memory_order_relaxed);
  entry.agreedBytes.store(call.agreedBytes, std::memory_order_relaxed);
  const bool fits = storeInline(inputs, entry.inputs) && storeInline(outputs, entry.outputs);
  if (!fits) {
    entry.inputs.layout.store(kSpilled, std::memory_order_relaxed);
  }
  release(entry, version);
  if (!fits) {
    spill(id, inputs, outputs);
  }
  return id;
}

void FlightRecorder::spill(uint64_t id, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  Spill spilled{id, shapesOf(inputs), shapesOf(outputs)};
  std::lock_guard<std::mutex> lock(asideMutex_);
  spills_.push_back(std::move(spilled));
  keepLast(spills_, capacity_);
}

void FlightRecorder::advance(uint64_t id, State state, std::atomic<uint64_t> Entry::*field, uint64_t seq) {
  const uint64_t now = static_cast<uint64_t>(c10::getApproximateTime());
  Entry& entry = ring_[id % capacity_];
  const uint64_t version = acquire(entry);
  if (entry.id.load(std::memory_order_relaxed) == id) {
    if (seq != 0) {
      entry.seq.store(seq, std::memory_order_relaxed);
    }
    const uint64_t call = entry.call.load(std::memory_order_relaxed);
    entry.call.store((call & ~kStateMask) | static_cast<uint64_t>(state) << kStateShift, std::memory_order_relaxed);
    (entry.*field).store(now, std::memory_order_relaxed);
  }
  release(entry, version);
}

void FlightRecorder::started(uint64_t id, uint64_t seq) {
  if (id == 0) {
    return;
  }
  advance(id, State::kStarted, &Entry::started, seq);
}

void FlightRecorder::finished(uint64_t id, const std::string& error) {
  if (id == 0) {
    return;
  }
  advance(id, error.empty() ? State::kCompleted : State::kFailed, &Entry::completed, 0);
  if (!error.empty()) {
    hasFailure_.store(true, std::memory_order_release);
    std::lock_guard<std::mutex> lock(asideMutex_);
    errors_.emplace_back(id, error);
    keepLast(errors_, capacity_);
  }
}

bool FlightRecorder::snapshot(uint64_t id, Snapshot& out) {
  const Entry& entry = ring_[id % capacity_];
  for (int tries = 0; tries < kSnapshotTries; ++tries) {
    const uint64_t before = entry.version.load(std::memory_order_acquire);
    if (before & 1) {
      std::this_thread::yield();
      continue;
    }
    out.id = entry.id.load(std::memory_order_relaxed);
    out.seq = entry.seq.load(std::memory_order_relaxed);
    out.title = entry.title.load(std::memory_order_relaxed);
    out.call = entry.call.load(std::memory_order_relaxed);
    out.created = entry.created.load(std::memory_order_relaxed);
    out.started = entry.started.load(std::memory_order_relaxed);
    out.completed = entry.completed.load(std::memory_order_relaxed);
    out.reduceOp = entry.reduceOp.load(std::memory_order_relaxed);
    out.agreedBytes = entry.agreedBytes.load(std::memory_order_relaxed);
    const bool spilled = entry.inputs.layout.load(std::memory_order_relaxed) & kSpilled;
    if (!spilled) {
      out.inputs = loadInline(entry.inputs);
      out.outputs = loadInline(entry.outputs);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (entry.version.load(std::memory_order_relaxed) != before) {
      continue;
    }
    if (out.id != id) {
      return false;
    }
    if (spilled) {
      std::lock_guard<std::mutex> lock(asideMutex_);
      for (const Spill& s : spills_) {
        if (s.id == id) {
          out.inputs = s.inputs;
          out.outputs = s.outputs;
        }
      }
    }
    return true;
  }
  return false;
}

void FlightRecorder::setStackProvider(StackProvider provider) {
  stackProvider.store(provider, std::memory_order_release);
}

FlightRecorder::PresetStacks::PresetStacks(std::string stacks) : stacks_(std::move(stacks)), prior_(presetStacks) {
  presetStacks = &stacks_;
}

FlightRecorder::PresetStacks::~PresetStacks() {
  presetStacks = prior_;
}

std::string FlightRecorder::dumpPath() const {
  return dir_ + "/rank" + std::to_string(rank_) + ".json";
}

std::string FlightRecorder::errorNote(const std::string& path) {
  if (path.empty()) {
    return "";
  }
  const std::string dir = path.substr(0, path.rfind('/'));
  return "; flight recorder: " + path + " (every rank's: python -m torch_torus.trace " + dir + ")";
}

std::string FlightRecorder::render(const std::string& reason, const std::string& waitingFor) {
  static const char* const states[] = {"scheduled", "started", "completed", "failed"};
  // Times since the epoch, as torch's are, so that ranks on different hosts compare.
  const auto toEpoch = clock_->makeConverter();
  const auto epoch = [&toEpoch](uint64_t t) {
    return t ? std::to_string(toEpoch(static_cast<c10::approx_time_t>(t))) : std::string("null");
  };
  const int64_t nowEpoch =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  std::ostringstream out;
  out << "{\n  \"version\": \"torus-1\",\n  \"pg_id\": " << quoted(groupName_) << ",\n  \"rank\": " << rank_
      << ",\n  \"world_size\": " << size_ << ",\n  \"dump_reason\": " << quoted(reason)
      << ",\n  \"time_dumped_ns\": " << nowEpoch << ",\n  \"python_stacks\": ";
  const StackProvider stacks = stackProvider.load(std::memory_order_acquire);
  const std::string stackText = presetStacks ? *presetStacks : stacks ? stacks() : std::string();
  out << (stackText.empty() ? std::string("null") : quoted(stackText)) << ",\n  \"entries\": [";
  const uint64_t next = nextId_.load(std::memory_order_relaxed);
  bool any = false;
  Snapshot entry;
  for (uint64_t id = next > capacity_ ? next - capacity_ : 1; id < next; ++id) {
    if (!snapshot(id, entry)) {
      continue;
    }
    const bool p2p = entry.call & (uint64_t{1} << 8);
    const auto dtype = quoted(c10::toString(static_cast<at::ScalarType>(entry.call & 0xff)));
    const auto state = static_cast<State>((entry.call & kStateMask) >> kStateShift);
    std::string error;
    if (state == State::kFailed) {
      std::lock_guard<std::mutex> lock(asideMutex_);
      for (const auto& [failed, text] : errors_) {
        if (failed == id) {
          error = text;
        }
      }
    }
    out << (any ? ",\n" : "\n") << "    {\"record_id\": " << id << ", \"pg_id\": " << quoted(groupName_)
        << ", \"collective_seq_id\": " << (p2p ? 0 : entry.seq) << ", \"p2p_seq_id\": " << (p2p ? entry.seq : 0)
        << ", \"profiling_name\": " << quoted(entry.title) << ", \"is_p2p\": " << (p2p ? "true" : "false")
        << ", \"input_sizes\": " << shapes(entry.inputs) << ", \"output_sizes\": " << shapes(entry.outputs)
        << ", \"input_dtypes\": [" << dtype << "], \"output_dtypes\": [" << dtype << "]"
        << ", \"root_or_peer\": " << static_cast<int32_t>(entry.call >> 32)
        << ", \"reduce_op\": " << (entry.reduceOp ? quoted(entry.reduceOp) : std::string("null"))
        << ", \"agreed_bytes\": " << entry.agreedBytes
        << ", \"issued_by\": " << quoted(entry.call & (uint64_t{1} << 9) ? "callback" : "caller")
        << ", \"state\": " << quoted(states[static_cast<int>(state)])
        << ", \"time_created_ns\": " << epoch(entry.created)
        << ", \"time_discovered_started_ns\": " << epoch(entry.started)
        << ", \"time_discovered_completed_ns\": " << epoch(entry.completed) << ", \"error\": " << quoted(error)
        << ", \"waiting_for\": " << quoted(state == State::kStarted && !p2p ? waitingFor : "") << "}";
    any = true;
  }
  out << "\n  ]\n}\n";
  return out.str();
}

std::string FlightRecorder::dump(const std::string& reason, const std::string& waitingFor) {
  if (!enabled()) {
    return "";
  }
  std::lock_guard<std::mutex> lock(dumpMutex_);
  const std::string text = render(reason, waitingFor);
  const std::string path = dumpPath();
  // The directories above the base (TORUS_TRACE_DIR's parents) are the user's to choose; the base
  // and the group's directory in it are this user's own.
  const std::filesystem::path group(dir_);
  const std::filesystem::path base = group.parent_path();
  std::error_code ignored;
  if (!base.parent_path().empty()) {
    std::filesystem::create_directories(base.parent_path(), ignored);
  }
  std::string problem = ownDirectory(base.string());
  if (problem.empty()) {
    problem = ownDirectory(dir_);
  }
  const std::string temporary =
      path + "." + std::to_string(::getpid()) + "." + std::to_string(++dumpsWritten_) + ".tmp";
  if (problem.empty()) {
    problem = writeNewFile(temporary, text);
  }
  if (problem.empty() && std::rename(temporary.c_str(), path.c_str()) != 0) {
    problem = "cannot rename " + temporary + ": " + std::strerror(errno);
    ::unlink(temporary.c_str());
  }
  if (!problem.empty()) {
    std::fprintf(stderr, "[torus rank %d] the flight recorder's dump was not written: %s\n", rank_, problem.c_str());
    return "";
  }
  return path;
}

} // namespace torus
