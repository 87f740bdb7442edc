// A TensorBoard event-file writer, written from the format spec (no TensorFlow, no protobuf
// library): TFRecord framing around hand-encoded `tensorboard.Event` protobuf messages.
//
// TFRecord framing, one record per event (little-endian):
//   uint64 length | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)
//   masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8, c = CRC32C (Castagnoli) of x.
// Messages (field numbers from tensorflow/tensorboard, tensorboard/compat/proto/):
//   event.proto    Event { double wall_time = 1; int64 step = 2;
//                          oneof what { string file_version = 3; Summary summary = 5; } }
//   summary.proto  Summary { repeated Value value = 1; }
//                  Summary.Value { string tag = 1; SummaryMetadata metadata = 9;
//                                  oneof value { float simple_value = 2; TensorProto tensor = 8; } }
//                  SummaryMetadata { PluginData plugin_data = 1; }
//                  SummaryMetadata.PluginData { string plugin_name = 1; }
//   tensor.proto   TensorProto { DataType dtype = 1; TensorShapeProto tensor_shape = 2;
//                                repeated bytes string_val = 8; }   (types.proto: DT_STRING = 7)
// The first record of a file is an Event with file_version = "brain.Event:2".
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::train {

namespace tb {

// The TFRecord mask of a CRC32C over `n` bytes.
std::uint32_t masked_crc32c(const void* data, std::size_t n);

// One TFRecord: length, masked CRC of the length, data, masked CRC of the data.
std::string frame_record(std::string_view data);

// Serialized Event messages (protobuf wire format, fields in field-number order).
std::string encode_file_version_event(double wall_time);
std::string encode_scalars_event(double wall_time, std::int64_t step,
                                 const std::vector<std::pair<std::string, float>>& values);
// A text summary, as the TensorBoard text plugin reads it: a scalar DT_STRING tensor with
// plugin_name "text" in the value's metadata.
std::string encode_text_event(double wall_time, std::int64_t step, std::string_view tag,
                              std::string_view text);

// events.out.tfevents.<unix-seconds>.<hostname>.<pid>.<n>, n counting files this process made.
std::string event_file_name(std::int64_t unix_seconds);

}  // namespace tb

// Appends events to a new event file in an existing directory. Throws keel::Error naming the
// file when it cannot be created or written.
class TbWriter {
 public:
  explicit TbWriter(const std::string& dir);
  ~TbWriter();
  TbWriter(const TbWriter&) = delete;
  TbWriter& operator=(const TbWriter&) = delete;

  const std::string& path() const { return path_; }

  void scalars(std::int64_t step, const std::vector<std::pair<std::string, float>>& values,
               double wall_time);
  void text(std::int64_t step, std::string_view tag, std::string_view text, double wall_time);
  void flush();

 private:
  void write_record(std::string_view event);

  std::string path_;
  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, FileCloser> file_;
};

// Seconds since the Unix epoch, with sub-second resolution (Event.wall_time).
double unix_time_now();

}  // namespace keel::train
