#include "train/metrics_log.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "common/error.h"
#include "train/tb_writer.h"

namespace keel::train {

MetricsLog::MetricsLog(const std::string& dir, bool tensorboard) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("cannot create metrics directory {}: {}", dir, ec.message());
  jsonl_path_ = jsonl_path_in(dir);
  jsonl_.reset(std::fopen(jsonl_path_.c_str(), "ab"));
  if (jsonl_ == nullptr) fail("cannot open {}: {}", jsonl_path_, std::strerror(errno));
  if (tensorboard) tb_ = std::make_unique<TbWriter>(dir);
}

MetricsLog::~MetricsLog() = default;  // closing flushes both files

std::string MetricsLog::event_file_path() const { return tb_ ? tb_->path() : std::string(); }

void MetricsLog::write_line(const std::string& line) {
  if (std::fwrite(line.data(), 1, line.size(), jsonl_.get()) != line.size() ||
      std::fputc('\n', jsonl_.get()) == EOF || std::fflush(jsonl_.get()) != 0)
    fail("cannot write {}: {}", jsonl_path_, std::strerror(errno));
}

void MetricsLog::scalars(std::int64_t step,
                         const std::vector<std::pair<std::string, double>>& values) {
  const double now = unix_time_now();
  nlohmann::ordered_json line;
  line["step"] = step;
  line["time"] = now;
  std::vector<std::pair<std::string, float>> tb_values;
  for (const auto& [name, v] : values) {
    if (name == "step" || name == "time") fail("metrics log: the name '{}' is reserved", name);
    if (std::isfinite(v)) {
      line[name] = v;
      tb_values.emplace_back(name, static_cast<float>(v));
    } else {
      line[name] = nullptr;
    }
  }
  write_line(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  if (tb_) {
    tb_->scalars(step, tb_values, now);
    tb_->flush();
  }
}

void MetricsLog::text(std::int64_t step, const std::string& tag, const std::string& text) {
  if (tag == "step" || tag == "time") fail("metrics log: the name '{}' is reserved", tag);
  const double now = unix_time_now();
  nlohmann::ordered_json line;
  line["step"] = step;
  line["time"] = now;
  // Invalid UTF-8 becomes U+FFFD rather than an exception from deep inside a training run.
  line[tag] = text;
  write_line(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  if (tb_) {
    tb_->text(step, tag, text, now);
    tb_->flush();
  }
}

void MetricsLog::table(std::int64_t step, const std::string& name,
                       const std::vector<std::vector<std::int64_t>>& rows) {
  if (name == "step" || name == "time") fail("metrics log: the name '{}' is reserved", name);
  nlohmann::ordered_json line;
  line["step"] = step;
  line["time"] = unix_time_now();
  line[name] = rows;
  write_line(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

void MetricsLog::flush() {
  if (std::fflush(jsonl_.get()) != 0) fail("cannot write {}: {}", jsonl_path_, std::strerror(errno));
  if (tb_) tb_->flush();
}

}  // namespace keel::train
