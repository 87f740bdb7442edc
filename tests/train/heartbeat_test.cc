// keel train's heartbeat writer (train/heartbeat.h): the step loop's post() never waits for the
// file system. A write that is held (as a journaling file system holds a small write while a
// checkpoint's gigabytes are flushed) blocks only the writer's thread; records posted meanwhile
// are coalesced to the newest; flush() returns once everything posted is written; the first
// failure is reported once; the file writer leaves one whole JSON record in place.
#include "train/heartbeat.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace keel::train {
namespace {

// A write function whose first call is held until release().
struct HeldWrites {
  std::mutex m;
  std::condition_variable cv;
  bool held = true, entered = false;
  std::vector<std::string> written;

  HeartbeatWriter::WriteFn fn() {
    return [this](const std::string& text) {
      std::unique_lock<std::mutex> lock(m);
      entered = true;
      cv.notify_all();
      cv.wait(lock, [&] { return !held; });
      written.push_back(text);
      return std::string(text == "bad" ? "cannot write: injected" : "");
    };
  }
  void wait_entered() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return entered; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(m);
    held = false;
    cv.notify_all();
  }
};

TEST(HeartbeatWriter, PostReturnsWhileAWriteIsHeldAndTheNewestIsWrittenNext) {
  HeldWrites w;
  HeartbeatWriter hb(w.fn());
  hb.post("step 1");
  w.wait_entered();  // the writer's thread is now stuck in the file system
  // The step loop goes on: these return although no write can finish.
  hb.post("step 2");
  hb.post("step 3");
  hb.post("step 4");
  {
    std::lock_guard<std::mutex> lock(w.m);
    EXPECT_EQ(w.written, std::vector<std::string>{});
  }
  w.release();
  hb.flush();
  std::lock_guard<std::mutex> lock(w.m);
  EXPECT_EQ(w.written, (std::vector<std::string>{"step 1", "step 4"}));
}

TEST(HeartbeatWriter, FailuresAreReportedOnceAndTheLastPostIsWrittenOnDestruction) {
  HeldWrites w;
  w.release();
  {
    HeartbeatWriter hb(w.fn());
    hb.post("bad");
    hb.flush();
    EXPECT_EQ(hb.take_error(), "cannot write: injected");
    EXPECT_EQ(hb.take_error(), "");
    hb.post("done");
  }  // the destructor writes what was posted last
  std::lock_guard<std::mutex> lock(w.m);
  ASSERT_FALSE(w.written.empty());
  EXPECT_EQ(w.written.back(), "done");
}

TEST(HeartbeatWriter, TheFileWriterReplacesTheRecordWhole) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("keel_heartbeat_" + std::to_string(::getpid())) / "beats";
  fs::remove_all(dir.parent_path());
  {
    HeartbeatWriter hb(heartbeat_file_writer(dir.string(), 3));  // the directory is made
    hb.post("{\"step\": 1}\n");
    hb.post("{\"step\": 2}\n");
    hb.flush();
    EXPECT_EQ(hb.take_error(), "");
  }
  std::stringstream got;
  got << std::ifstream(dir / "rank-3.json").rdbuf();
  EXPECT_EQ(got.str(), "{\"step\": 2}\n");
  EXPECT_FALSE(fs::exists(dir / "rank-3.json.tmp"));
  // A directory that cannot be made is a failure to report, not an exception.
  const fs::path blocker = dir.parent_path() / "file";
  std::ofstream(blocker) << "x";
  {
    HeartbeatWriter hb(heartbeat_file_writer((blocker / "beats").string(), 0));
    hb.post("{}\n");
    hb.flush();
    EXPECT_NE(hb.take_error().find("cannot create"), std::string::npos);
  }
  fs::remove_all(dir.parent_path());
}

// The record keel run parses (run/supervisor.cc, beat_of): every field, the GPU only where the
// rank has one, the attempt's tag only on datagrams, one line.
TEST(HeartbeatJson, EveryFieldKeelRunReads) {
  HeartbeatRecord r;
  r.rank = 3, r.world = 4, r.host = "node7", r.pid = 4242, r.phase = "step", r.step = 17, r.time = 1.5e9;
  r.step_seconds = 0.25, r.wait_seconds = 0.125, r.device_seconds = 1e-4;
  const std::string cpu = heartbeat_json(r);
  EXPECT_EQ(cpu.find('\n'), std::string::npos);
  const auto j = nlohmann::json::parse(cpu);
  EXPECT_EQ(j["rank"], 3);
  EXPECT_EQ(j["world"], 4);
  EXPECT_EQ(j["host"], "node7");
  EXPECT_EQ(j["pid"], 4242);
  EXPECT_EQ(j["phase"], "step");
  EXPECT_EQ(j["step"], 17);
  EXPECT_DOUBLE_EQ(j["time"].get<double>(), 1.5e9);
  EXPECT_DOUBLE_EQ(j["step_seconds"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(j["wait_seconds"].get<double>(), 0.125);
  EXPECT_DOUBLE_EQ(j["device_seconds"].get<double>(), 1e-4);
  EXPECT_FALSE(j.contains("gpu")) << "a CPU rank names no GPU";
  EXPECT_FALSE(j.contains("tag")) << "the file's record carries no tag";
  r.gpu = "cuda:1 0000:1B:00.0";
  const auto tagged = nlohmann::ordered_json::parse(heartbeat_json(r, "2"));
  EXPECT_EQ(tagged["gpu"], "cuda:1 0000:1B:00.0");
  EXPECT_EQ(tagged["tag"], "2");
  EXPECT_EQ(std::prev(tagged.end()).key(), "tag");
}

}  // namespace
}  // namespace keel::train
