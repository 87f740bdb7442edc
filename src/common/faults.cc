#include "common/faults.h"

#include <signal.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <thread>

#include "common/error.h"
#include "common/watchdog.h"

namespace keel {
namespace {

// A whole decimal number (no sign, no spaces), or false.
bool parse_int(const std::string& s, std::int64_t& out) {
  if (s.empty() || s[0] < '0' || s[0] > '9') return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size();
}

std::string trimmed(const std::string& s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t b = 0;
  for (;;) {
    const std::size_t e = s.find(sep, b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

Fault parse_one(const std::string& word, const std::string& flag) {
  auto bad = [&](const std::string& why) { return UsageError(fmt::format("{} {}: {}", flag, word, why)); };
  const std::string form = "expected KIND@STEP[:rRANK][:ARG], e.g. kill@3:r1";
  if (word.empty()) throw UsageError(fmt::format("{} '': an empty fault ({})", flag, form));
  const std::size_t at = word.find('@');
  if (at == std::string::npos) throw bad(form);
  Fault f;
  f.spec = word;
  const std::string kind = word.substr(0, at);
  if (kind == "kill") f.kind = Fault::Kind::kKill;
  else if (kind == "exit") f.kind = Fault::Kind::kExit;
  else if (kind == "hang") f.kind = Fault::Kind::kHang;
  else if (kind == "slow") f.kind = Fault::Kind::kSlow;
  else if (kind == "nan") f.kind = Fault::Kind::kNan;
  else if (kind == "spike") f.kind = Fault::Kind::kSpike;
  else if (kind == "diskfull") f.kind = Fault::Kind::kDiskFull;
  else if (kind == "slowsave") f.kind = Fault::Kind::kSlowSave, f.sleep_ms = 5000;
  else if (kind == "health") f.kind = Fault::Kind::kHealth;
  else if (kind == "slowgpu") f.kind = Fault::Kind::kSlowGpu;
  else throw bad(fmt::format("unknown fault '{}' (kill, exit, hang, slow, nan, spike, diskfull, slowsave, health, slowgpu)", kind));
  const bool slow = f.kind == Fault::Kind::kSlow || f.kind == Fault::Kind::kSlowGpu;
  const std::vector<std::string> fields = split(word.substr(at + 1), ':');

  auto step = [&](const std::string& s) {
    std::int64_t v = 0;
    if (!parse_int(s, v)) throw bad(fmt::format("'{}' is not a step (a number >= 1)", s));
    if (v < 1) throw bad(fmt::format("step {}: steps count from 1", v));
    return v;
  };
  const std::string& steps = fields[0];
  if (const std::size_t dash = steps.find('-'); dash != std::string::npos && dash > 0) {
    if (!slow) throw bad(fmt::format("a step range is for slow and slowgpu only ({} fires at one step)", kind));
    f.first_step = step(steps.substr(0, dash));
    f.last_step = step(steps.substr(dash + 1));
    if (f.last_step < f.first_step)
      throw bad(fmt::format("the range {}-{} ends before it starts", f.first_step, f.last_step));
  } else {
    f.first_step = f.last_step = step(steps);
  }

  bool have_rank = false, have_arg = false;
  for (std::size_t i = 1; i < fields.size(); ++i) {
    const std::string& x = fields[i];
    std::int64_t v = 0;
    if (x.empty()) throw bad("an empty field after ':'");
    if (x[0] == 'r') {
      if (have_rank) throw bad("more than one rank");
      if (!parse_int(x.substr(1), v) || v > 1'000'000)
        throw bad(fmt::format("'{}' is not a rank (rN: a world rank N >= 0)", x));
      f.rank = static_cast<int>(v);
      have_rank = true;
      continue;
    }
    if (have_arg) throw bad("more than one argument");
    have_arg = true;
    switch (f.kind) {
      case Fault::Kind::kExit:
        if (!parse_int(x, v) || v > 255) throw bad(fmt::format("'{}' is not an exit code (0-255)", x));
        f.exit_code = static_cast<int>(v);
        break;
      case Fault::Kind::kSlow:
      case Fault::Kind::kSlowSave:
        if (!parse_int(x, v) || v > 86'400'000) throw bad(fmt::format("'{}' is not milliseconds (0-86400000)", x));
        f.sleep_ms = v;
        break;
      case Fault::Kind::kSlowGpu:
        if (!parse_int(x, v) || v < 2 || v > 1000) throw bad(fmt::format("'{}' is not a slowdown factor (2-1000)", x));
        f.repeats = static_cast<int>(v);
        break;
      case Fault::Kind::kSpike: {
        char* end = nullptr;
        f.factor = std::strtod(x.c_str(), &end);
        if (end != x.c_str() + x.size() || !(x[0] >= '0' && x[0] <= '9') || !(f.factor > 0) || !std::isfinite(f.factor))
          throw bad(fmt::format("'{}' is not a loss factor (a number > 0)", x));
        break;
      }
      default:
        throw bad(fmt::format("{} takes no argument ('{}'; a rank is written r{})", kind, x, x));
    }
  }
  return f;
}

}  // namespace

FaultPlan parse_faults(const std::string& spec, const std::string& flag) {
  FaultPlan plan;
  for (const std::string& word : split(spec, ',')) plan.faults.push_back(parse_one(trimmed(word), flag));
  return plan;
}

void FaultPlan::before_step(std::int64_t step, int rank) const {
  auto due = [&](const Fault& f) { return f.rank == rank && step >= f.first_step && step <= f.last_step; };
  auto say = [&](const std::string& what) {
    std::fflush(stdout);  // the step lines before it
    std::fprintf(stderr, "keel: fault injection: rank %d %s at step %lld\n", rank, what.c_str(),
                 static_cast<long long>(step));
    std::fflush(stderr);
  };
  for (const Fault& f : faults)
    if (f.kind == Fault::Kind::kSlowGpu && due(f) && step == f.first_step)
      say(fmt::format("runs its device canary {} times as long (a GPU {} times slower) to step {}", f.repeats,
                      f.repeats, f.last_step));
  for (const Fault& f : faults)
    if (f.kind == Fault::Kind::kSlow && due(f)) {
      say(fmt::format("sleeps {} ms", f.sleep_ms));
      std::this_thread::sleep_for(std::chrono::milliseconds(f.sleep_ms));
    }
  for (const Fault& f : faults) {
    if (!due(f)) continue;
    switch (f.kind) {
      case Fault::Kind::kKill:
        say("killed");
        ::kill(::getpid(), SIGKILL);
        for (;;) ::pause();  // until the signal lands
      case Fault::Kind::kExit:
        say(fmt::format("exits with code {}", f.exit_code));
        ::_exit(f.exit_code);
      case Fault::Kind::kHang:
        say("hangs");
        hang_forever();
      default:
        break;
    }
  }
}

namespace {
// The fault of `kind` due on world rank `rank` at step `step`, or null.
const Fault* due_at(const std::vector<Fault>& faults, Fault::Kind kind, std::int64_t step, int rank) {
  for (const Fault& f : faults)
    if (f.kind == kind && f.rank == rank && step >= f.first_step && step <= f.last_step) return &f;
  return nullptr;
}
}  // namespace

bool FaultPlan::nan_at(std::int64_t step, int rank) const { return due_at(faults, Fault::Kind::kNan, step, rank); }

double FaultPlan::loss_factor_at(std::int64_t step, int rank) const {
  const Fault* f = due_at(faults, Fault::Kind::kSpike, step, rank);
  return f ? f->factor : 1.0;
}

int FaultPlan::canary_repeats_at(std::int64_t step, int rank) const {
  const Fault* f = due_at(faults, Fault::Kind::kSlowGpu, step, rank);
  return f ? f->repeats : 1;
}

bool FaultPlan::disk_full_at(std::int64_t step, int rank) const {
  return due_at(faults, Fault::Kind::kDiskFull, step, rank);
}

std::int64_t FaultPlan::save_delay_ms_at(std::int64_t step, int rank) const {
  const Fault* f = due_at(faults, Fault::Kind::kSlowSave, step, rank);
  return f ? f->sleep_ms : 0;
}

}  // namespace keel
