// Errors a user can act on. Anything the user got wrong (flags, configs, files) or the
// environment refused (a CUDA/NCCL/MPI call) is thrown as keel::Error with a one-line
// message; the CLI prints "keel: error: <message>" and exits non-zero.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace keel {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// An error every rank hits identically (a bad flag or config): under a launcher only rank 0
// prints it, so N ranks do not print N copies.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& what) : Error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Exit codes shared by every subcommand.
enum ExitCode : int {
  kExitOk = 0,
  kExitError = 1,        // bad input or a failed library call
  kExitCheckFailed = 2,  // a result did not match its expected value
  kExitBelowGate = 3,    // a health gate (e.g. --min-busbw) was not met
  kExitTimeout = 124,    // an operation hung past --timeout
};

}  // namespace keel
