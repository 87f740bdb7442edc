// The metrics log of `keel train`: JSONL lines parse back (non-finite values as null); the
// TensorBoard event file's TFRecord framing and CRCs verify with an independent decoder (a
// bitwise CRC32C here, not keel's table-driven one); the protobuf bytes of one event match a
// hand-computed sequence. MetricsLog.WritesEventFileForTensorBoard also writes the file that
// tests/train/check_tensorboard.py reads with the real tensorboard package
// (ctest: train_tensorboard_reads_keel_events).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fileio.h"
#include "train/metrics_log.h"
#include "train/tb_writer.h"

namespace fs = std::filesystem;
using keel::train::MetricsLog;
namespace tb = keel::train::tb;

namespace {

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("keel_metrics_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::string only_event_file(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      found.push_back(e.path().string());
  EXPECT_EQ(found.size(), 1u);
  return found.empty() ? std::string() : found[0];
}

// ---- An independent decoder: bitwise CRC32C, TFRecord framing, protobuf wire format. ----

std::uint32_t crc32c_bitwise(const std::string& s) {
  std::uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

std::uint32_t mask(std::uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

std::uint64_t le(const std::string& s, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

// Splits a TFRecord file into records, checking both CRCs of each.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> records;
  std::size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "truncated record header";
    if (at + 12 > file.size()) break;
    const std::uint64_t n = le(file, at, 8);
    EXPECT_EQ(le(file, at + 8, 4), mask(crc32c_bitwise(file.substr(at, 8)))) << "length CRC at " << at;
    EXPECT_LE(at + 12 + n + 4, file.size()) << "truncated record";
    if (at + 12 + n + 4 > file.size()) break;
    std::string data = file.substr(at + 12, n);
    EXPECT_EQ(le(file, at + 12 + n, 4), mask(crc32c_bitwise(data))) << "data CRC at " << at;
    records.push_back(std::move(data));
    at += 12 + n + 4;
  }
  return records;
}

struct Field {
  int number = 0;
  int wire = 0;
  std::uint64_t integer = 0;  // varint, fixed32, fixed64
  std::string bytes;          // length-delimited
};

std::uint64_t varint(const std::string& s, std::size_t& at) {
  std::uint64_t v = 0;
  for (int shift = 0; at < s.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(s[at++]);
    v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  ADD_FAILURE() << "truncated varint";
  return v;
}

std::vector<Field> fields(const std::string& msg) {
  std::vector<Field> out;
  std::size_t at = 0;
  while (at < msg.size()) {
    const std::uint64_t key = varint(msg, at);
    Field f;
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    switch (f.wire) {
      case 0: f.integer = varint(msg, at); break;
      case 1: f.integer = le(msg, at, 8); at += 8; break;
      case 5: f.integer = le(msg, at, 4); at += 4; break;
      case 2: {
        const std::uint64_t n = varint(msg, at);
        f.bytes = msg.substr(at, n);
        at += n;
        break;
      }
      default: ADD_FAILURE() << "wire type " << f.wire; return out;
    }
    EXPECT_LE(at, msg.size());
    out.push_back(f);
  }
  return out;
}

double as_double(std::uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

float as_float(std::uint64_t bits) {
  const auto b = static_cast<std::uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

struct DecodedEvent {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> scalars;
};

DecodedEvent decode_event(const std::string& data) {
  DecodedEvent e;
  for (const Field& f : fields(data)) {
    if (f.number == 1 && f.wire == 1) e.wall_time = as_double(f.integer);
    else if (f.number == 2 && f.wire == 0) e.step = static_cast<std::int64_t>(f.integer);
    else if (f.number == 3 && f.wire == 2) e.file_version = f.bytes;
    else if (f.number == 5 && f.wire == 2) {
      for (const Field& v : fields(f.bytes)) {
        EXPECT_EQ(v.number, 1);  // Summary.value
        std::string tag;
        float value = std::nanf("");
        for (const Field& x : fields(v.bytes)) {
          if (x.number == 1) tag = x.bytes;
          if (x.number == 2 && x.wire == 5) value = as_float(x.integer);
        }
        if (!std::isnan(value)) e.scalars.emplace_back(tag, value);
      }
    } else ADD_FAILURE() << "unexpected Event field " << f.number;
  }
  return e;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

// The log the tests write: steps 0..4, a NaN grad norm at step 2.
void write_sample_log(MetricsLog& log) {
  log.text(0, "config", "model: tiny\nsteps: 5");
  for (int step = 0; step < 5; ++step) {
    const double gnorm = step == 2 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / (step + 1);
    log.scalars(step, {{"loss", 10.0 - 0.5 * step},
                       {"lr", 1e-4 * (step + 1)},
                       {"grad_norm", gnorm},
                       {"tokens_per_s", 12345.0 + step},
                       {"mfu", 0.25},
                       {"mem_gib", 3.5},
                       {"expert_load/max", 1.5}});
  }
}

}  // namespace

TEST(MetricsLog, CrcMaskMatchesSpec) {
  // crc32c("123456789") == 0xE3069283 (the standard check value), masked per the TFRecord spec.
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xE3069283u);
  EXPECT_EQ(tb::masked_crc32c("123456789", 9), mask(0xE3069283u));
  EXPECT_EQ(tb::masked_crc32c("123456789", 9), 0xC78AB0E5u);  // tensorboard's masked_crc32c agrees
}

TEST(MetricsLog, KnownEventBytes) {
  // Event{wall_time=1.5, step=300, summary{value{tag="loss", simple_value=2.0f}}}, by hand:
  const std::string expected =
      bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F,  // field 1 fixed64: 1.5 = 0x3FF8000000000000
             0x10, 0xAC, 0x02,                    // field 2 varint: 300
             0x2A, 0x0D,                          // field 5 (summary), 13 bytes
             0x0A, 0x0B,                          //   Summary.value (1), 11 bytes
             0x0A, 0x04, 'l', 'o', 's', 's',      //     Value.tag (1)
             0x15, 0, 0, 0, 0x40});               //     Value.simple_value (2) fixed32: 2.0f
  EXPECT_EQ(tb::encode_scalars_event(1.5, 300, {{"loss", 2.0f}}), expected);

  // Event{wall_time=0.0, file_version="brain.Event:2"}.
  EXPECT_EQ(tb::encode_file_version_event(0.0),
            bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0, 0x1A, 13}) + "brain.Event:2");

  // A record around 1 byte: length 1, masked CRCs of the 8 length bytes and of the data.
  const std::string rec = tb::frame_record("x");
  ASSERT_EQ(rec.size(), 8u + 4 + 1 + 4);
  EXPECT_EQ(rec.substr(0, 8), bytes({1, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(le(rec, 8, 4), mask(crc32c_bitwise(bytes({1, 0, 0, 0, 0, 0, 0, 0}))));
  EXPECT_EQ(rec[12], 'x');
  EXPECT_EQ(le(rec, 13, 4), mask(crc32c_bitwise("x")));
}

TEST(MetricsLog, NegativeStepIsTenByteVarint) {
  const std::string e = tb::encode_scalars_event(0.0, -1, {});
  // field 2 varint -1 (two's complement, 10 bytes), then an empty summary (field 5, length 0)
  EXPECT_EQ(e.substr(9),
            bytes({0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01, 0x2A, 0x00}));
}

TEST(MetricsLog, EventFileFramingAndCrcsVerify) {
  const std::string dir = temp_dir("events");
  {
    MetricsLog log(dir, true);
    write_sample_log(log);
  }
  const std::string path = only_event_file(dir);
  const std::string name = fs::path(path).filename().string();
  // events.out.tfevents.<unix-seconds>.<hostname>.<pid>.<n>
  EXPECT_TRUE(name.find("." + std::to_string(::getpid()) + ".") != std::string::npos) << name;

  const std::vector<std::string> records = read_records(keel::read_file(path));
  ASSERT_EQ(records.size(), 1u + 1 + 5);  // file_version, config text, 5 steps
  const DecodedEvent first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_GT(first.wall_time, 1.6e9);
  for (int step = 0; step < 5; ++step) {
    const DecodedEvent e = decode_event(records[2 + step]);
    EXPECT_EQ(e.step, step);
    EXPECT_GE(e.wall_time, first.wall_time);
    ASSERT_EQ(e.scalars.size(), step == 2 ? 6u : 7u) << "a NaN is left out of TensorBoard";
    EXPECT_EQ(e.scalars[0].first, "loss");
    EXPECT_EQ(e.scalars[0].second, static_cast<float>(10.0 - 0.5 * step));
    EXPECT_EQ(e.scalars[1].first, "lr");
    EXPECT_EQ(e.scalars[1].second, static_cast<float>(1e-4 * (step + 1)));
    EXPECT_EQ(e.scalars.back().first, "expert_load/max");
  }

  // A flipped byte in the last record's data fails its data CRC.
  std::string bad = keel::read_file(path);
  bad[bad.size() - 6] ^= 0x01;
  const std::vector<std::string> ok = records;
  std::size_t at = 0;
  for (std::size_t i = 0; i + 1 < ok.size(); ++i) at += 12 + ok[i].size() + 4;
  const std::string last_data = bad.substr(at + 12, ok.back().size());
  EXPECT_NE(le(bad, at + 12 + ok.back().size(), 4), mask(crc32c_bitwise(last_data)));
  fs::remove_all(dir);
}

TEST(MetricsLog, JsonlLinesParseBack) {
  const std::string dir = temp_dir("jsonl");
  {
    MetricsLog log(dir, false);
    write_sample_log(log);
    log.flush();
  }
  EXPECT_EQ(fs::exists(dir + "/metrics.jsonl"), true);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind("events.out.tfevents.", 0), std::string::npos)
        << "no event file without tensorboard";

  const std::vector<std::string> lines = lines_of(keel::read_file(dir + "/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 6u);
  const auto config = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(config["step"], 0);
  EXPECT_EQ(config["config"], "model: tiny\nsteps: 5");
  double prev_time = 0;
  for (int step = 0; step < 5; ++step) {
    const auto j = nlohmann::ordered_json::parse(lines[1 + step]);
    EXPECT_EQ(j.begin().key(), "step");  // fields in the order written
    EXPECT_EQ(j["step"].get<std::int64_t>(), step);
    EXPECT_GE(j["time"].get<double>(), prev_time);
    prev_time = j["time"].get<double>();
    EXPECT_EQ(j["loss"].get<double>(), 10.0 - 0.5 * step);  // doubles round-trip exactly
    EXPECT_EQ(j["lr"].get<double>(), 1e-4 * (step + 1));
    if (step == 2) EXPECT_TRUE(j["grad_norm"].is_null());
    else EXPECT_EQ(j["grad_norm"].get<double>(), 1.0 / (step + 1));
    EXPECT_EQ(j["expert_load/max"].get<double>(), 1.5);
  }

  // A second log in the same directory appends (a resumed run continues its log).
  {
    MetricsLog log(dir, false);
    log.scalars(5, {{"loss", std::numeric_limits<double>::infinity()}});
  }
  const std::vector<std::string> more = lines_of(keel::read_file(dir + "/metrics.jsonl"));
  ASSERT_EQ(more.size(), 7u);
  EXPECT_TRUE(nlohmann::json::parse(more[6])["loss"].is_null());
  fs::remove_all(dir);
}

TEST(MetricsLog, TablesAreJsonlOnly) {
  const std::string dir = temp_dir("table");
  {
    MetricsLog log(dir, true);
    log.table(3, "routing_counts", {{5, 0, 7}, {1, 2, 9}});
    EXPECT_THROW(log.table(3, "time", {{1}}), keel::Error);
  }
  const std::vector<std::string> lines = lines_of(keel::read_file(dir + "/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 1u);
  const auto j = nlohmann::ordered_json::parse(lines[0]);
  EXPECT_EQ(j.begin().key(), "step");
  EXPECT_EQ(j["step"].get<std::int64_t>(), 3);
  EXPECT_GT(j["time"].get<double>(), 0);
  EXPECT_EQ(j["routing_counts"], nlohmann::json::parse("[[5, 0, 7], [1, 2, 9]]"));
  fs::remove_all(dir);
}

TEST(MetricsLog, ReservedNamesAndBadDirectory) {
  const std::string dir = temp_dir("errors");
  MetricsLog log(dir, false);
  EXPECT_THROW(log.scalars(0, {{"step", 1.0}}), keel::Error);
  std::ofstream(dir + "/file") << "x";
  EXPECT_THROW(MetricsLog(dir + "/file/sub", true), keel::Error);
  fs::remove_all(dir);
}

// Writes the sample log into $KEEL_TB_TEST_DIR when set (check_tensorboard.sh then reads it
// with the real tensorboard package), into a temporary directory otherwise.
TEST(MetricsLog, WritesEventFileForTensorBoard) {
  const char* env = std::getenv("KEEL_TB_TEST_DIR");
  const std::string dir = env != nullptr && *env != '\0' ? std::string(env) : temp_dir("tb");
  {
    MetricsLog log(dir, true);
    write_sample_log(log);
  }
  EXPECT_FALSE(only_event_file(dir).empty());
  EXPECT_TRUE(fs::exists(dir + "/metrics.jsonl"));
  if (env == nullptr || *env == '\0') fs::remove_all(dir);
}
