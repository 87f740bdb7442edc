// The message of the error a test expects a call to throw, for the many tests that check that
// bad input gets a clear one-line error naming what is wrong.
#pragma once

#include <string>
#include <utility>

#include "common/error.h"

namespace keel::test {

// What f() throws as an E (keel::Error by default; a narrower type such as UsageError makes any
// other error propagate and fail the test), or `none` when f returns.
template <typename E = keel::Error, typename F>
std::string error_message(F&& f, std::string none = "") {
  try {
    std::forward<F>(f)();
  } catch (const E& e) {
    return e.what();
  }
  return none;
}

}  // namespace keel::test
