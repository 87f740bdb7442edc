#include "train/heartbeat.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace keel::train {

std::string heartbeat_json(const HeartbeatRecord& r, const std::string& tag) {
  nlohmann::ordered_json j;
  j["rank"] = r.rank;
  j["step"] = r.step;
  j["time"] = r.time;
  j["step_seconds"] = r.step_seconds;
  j["wait_seconds"] = r.wait_seconds;
  j["device_seconds"] = r.device_seconds;
  j["phase"] = r.phase;
  j["host"] = r.host;
  j["pid"] = r.pid;
  if (!r.gpu.empty()) j["gpu"] = r.gpu;
  j["world"] = r.world;
  if (!tag.empty()) j["tag"] = tag;
  return j.dump();
}

HeartbeatWriter::HeartbeatWriter(WriteFn write) : write_(std::move(write)), thread_([this] { loop(); }) {}

HeartbeatWriter::~HeartbeatWriter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void HeartbeatWriter::post(std::string text) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = std::move(text);
    ++posted_;
  }
  cv_.notify_all();
}

void HeartbeatWriter::flush() {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::uint64_t target = posted_;
  cv_.wait(lock, [&] { return written_ >= target; });
}

std::string HeartbeatWriter::take_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(error_, std::string());
}

void HeartbeatWriter::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || pending_.has_value(); });
    if (!pending_) return;  // stopping, everything written
    std::string text = std::move(*pending_);
    pending_.reset();
    const std::uint64_t upto = posted_;  // what this write covers (older records were replaced)
    lock.unlock();
    std::string why = write_(text);
    lock.lock();
    if (!why.empty() && error_.empty()) error_ = std::move(why);
    written_ = upto;
    cv_.notify_all();
  }
}

HeartbeatWriter::WriteFn heartbeat_file_writer(std::string dir, int rank) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / fmt::format("rank-{}.json", rank)).string();
  return [dir = std::move(dir), path, made = false](const std::string& text) mutable -> std::string {
    if (!made) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec) return fmt::format("cannot create {}: {}", dir, ec.message());
      made = true;
    }
    const std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (!f) {
      made = false;  // made again next time (removed under the run?)
      return fmt::format("cannot write {}: {}", tmp, std::strerror(errno));
    }
    const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    const int err = errno;
    if (std::fclose(f) != 0 || !wrote) return fmt::format("cannot write {}: {}", tmp, std::strerror(wrote ? errno : err));
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      return fmt::format("cannot rename {} to {}: {}", tmp, path, std::strerror(errno));
    return {};
  };
}

}  // namespace keel::train
