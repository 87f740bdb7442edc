// The metrics log of `keel train`: one JSON line per logged step in <dir>/metrics.jsonl and,
// when enabled, the same scalars in a TensorBoard event file in <dir>
// (events.out.tfevents.<unix-seconds>.<hostname>.<pid>.<n>, see tb_writer.h).
//
// Each scalars() call writes one line {"step":S,"time":T,"<name>":<value>,...} with the values
// in the order given ("time" is Unix seconds) and flushes it, so a crash loses no logged step.
// Values must be finite: a NaN or infinity is written as null in JSONL (the line still records
// that the step happened) and left out of TensorBoard (which cannot plot it); TensorBoard
// stores values as float32. Value names "step" and "time" are reserved. Writes once per call;
// call it from one rank only.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace keel::train {

class TbWriter;

// Writes scalars to <dir>/metrics.jsonl and, when enabled, a TensorBoard event file in <dir>.
class MetricsLog {
 public:
  // Creates `dir` if needed; appends to an existing metrics.jsonl (a resumed run continues
  // its log) and starts a new event file. Throws keel::Error naming the path on failure.
  MetricsLog(const std::string& dir, bool tensorboard);
  ~MetricsLog();  // flushes and closes
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // A text entry (e.g. the run config at step 0): {"step":S,"time":T,"<tag>":"<text>"} in
  // JSONL and a text summary (TensorBoard's Text tab) in the event file.
  void text(std::int64_t step, const std::string& tag, const std::string& text);
  // A table of integers (e.g. every MoE layer's per-class routing counts):
  // {"step":S,"time":T,"<name>":[[...],...]} in JSONL only (TensorBoard has no place for it).
  void table(std::int64_t step, const std::string& name, const std::vector<std::vector<std::int64_t>>& rows);
  void flush();

  const std::string& jsonl_path() const { return jsonl_path_; }
  // The JSONL file a log in `dir` writes.
  static std::string jsonl_path_in(const std::string& dir) { return dir + "/metrics.jsonl"; }
  // Empty when TensorBoard is off.
  std::string event_file_path() const;

 private:
  void write_line(const std::string& line);

  std::string jsonl_path_;
  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, FileCloser> jsonl_;
  std::unique_ptr<TbWriter> tb_;
};

}  // namespace keel::train
