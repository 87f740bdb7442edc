#include "train/tb_writer.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "ckpt/checksum.h"
#include "common/error.h"
#include "common/host.h"

namespace keel::train {
namespace tb {
namespace {

// Protobuf wire types (https://protobuf.dev/programming-guides/encoding/).
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kFixed32 = 5;

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint64_t>(wire_type));
}

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_double(std::string& out, int field, double v) {
  std::uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, int field, float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

// int64 fields are plain varints: a negative value takes 10 bytes (two's complement).
void put_int64(std::string& out, int field, std::int64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<std::uint64_t>(v));
}

void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event fields (event.proto).
constexpr int kEventWallTime = 1;
constexpr int kEventStep = 2;
constexpr int kEventFileVersion = 3;
constexpr int kEventSummary = 5;
// Summary (summary.proto).
constexpr int kSummaryValue = 1;
constexpr int kValueTag = 1;
constexpr int kValueSimpleValue = 2;
constexpr int kValueTensor = 8;
constexpr int kValueMetadata = 9;
constexpr int kMetadataPluginData = 1;
constexpr int kPluginDataPluginName = 1;
// TensorProto (tensor.proto), DataType (types.proto).
constexpr int kTensorDtype = 1;
constexpr int kTensorShape = 2;
constexpr int kTensorStringVal = 8;
constexpr int kDtString = 7;

std::string event_with_summary(double wall_time, std::int64_t step, const std::string& summary) {
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_int64(e, kEventStep, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}

}  // namespace

std::uint32_t masked_crc32c(const void* data, std::size_t n) {
  const std::uint32_t c = ckpt::crc32c(0, data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame_record(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  const std::uint32_t len_crc = masked_crc32c(out.data(), 8);
  put_le(out, len_crc, 4);
  out.append(data);
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

std::string encode_file_version_event(double wall_time) {
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_bytes(e, kEventFileVersion, "brain.Event:2");
  return e;
}

std::string encode_scalars_event(double wall_time, std::int64_t step,
                                 const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, kValueTag, tag);
    put_float(value, kValueSimpleValue, v);
    put_bytes(summary, kSummaryValue, value);
  }
  return event_with_summary(wall_time, step, summary);
}

std::string encode_text_event(double wall_time, std::int64_t step, std::string_view tag,
                              std::string_view text) {
  std::string plugin_data;
  put_bytes(plugin_data, kPluginDataPluginName, "text");
  std::string metadata;
  put_bytes(metadata, kMetadataPluginData, plugin_data);
  std::string tensor;
  put_key(tensor, kTensorDtype, kVarint);
  put_varint(tensor, kDtString);
  put_bytes(tensor, kTensorShape, "");  // rank 0: a scalar string
  put_bytes(tensor, kTensorStringVal, text);
  std::string value;
  put_bytes(value, kValueTag, tag);
  put_bytes(value, kValueTensor, tensor);
  put_bytes(value, kValueMetadata, metadata);
  std::string summary;
  put_bytes(summary, kSummaryValue, value);
  return event_with_summary(wall_time, step, summary);
}

std::string event_file_name(std::int64_t unix_seconds) {
  static std::atomic<int> counter{0};
  return "events.out.tfevents." + std::to_string(unix_seconds) + "." + host_name() + "." +
         std::to_string(static_cast<long>(getpid())) + "." + std::to_string(counter++);
}

}  // namespace tb

double unix_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

TbWriter::TbWriter(const std::string& dir) {
  const double now = unix_time_now();
  path_ = dir + "/" + tb::event_file_name(static_cast<std::int64_t>(now));
  file_.reset(std::fopen(path_.c_str(), "wb"));
  if (file_ == nullptr) fail("cannot create TensorBoard event file {}: {}", path_, std::strerror(errno));
  write_record(tb::encode_file_version_event(now));
  flush();
}

TbWriter::~TbWriter() = default;

void TbWriter::write_record(std::string_view event) {
  const std::string record = tb::frame_record(event);
  if (std::fwrite(record.data(), 1, record.size(), file_.get()) != record.size())
    fail("cannot write TensorBoard event file {}: {}", path_, std::strerror(errno));
}

void TbWriter::scalars(std::int64_t step, const std::vector<std::pair<std::string, float>>& values,
                       double wall_time) {
  if (values.empty()) return;
  write_record(tb::encode_scalars_event(wall_time, step, values));
}

void TbWriter::text(std::int64_t step, std::string_view tag, std::string_view text,
                    double wall_time) {
  write_record(tb::encode_text_event(wall_time, step, tag, text));
}

void TbWriter::flush() {
  if (std::fflush(file_.get()) != 0)
    fail("cannot write TensorBoard event file {}: {}", path_, std::strerror(errno));
}

}  // namespace keel::train
