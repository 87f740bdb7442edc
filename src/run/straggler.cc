#include "run/straggler.h"

#include <algorithm>
#include <vector>

namespace keel::run {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::optional<Straggler> StragglerWatch::add(int rank, std::int64_t step, double step_seconds, double wait_seconds,
                                             int world) {
  if (o_.factor <= 0 || world < 2 || o_.window < 1) return std::nullopt;
  Rank& me = ranks_[rank];
  if (step <= me.last_step) return std::nullopt;
  me.last_step = step;
  me.busy.push_back(std::max(0.0, step_seconds - wait_seconds));
  while (static_cast<int>(me.busy.size()) > o_.window) me.busy.pop_front();
  // every rank's window full, else no verdict yet
  if (static_cast<int>(ranks_.size()) < world) return std::nullopt;
  const auto figure = [&](const std::deque<double>& w) {
    return o_.fastest ? *std::min_element(w.begin(), w.end()) : median_of({w.begin(), w.end()});
  };
  std::vector<double> others;
  for (const auto& [r, x] : ranks_) {
    if (static_cast<int>(x.busy.size()) < o_.window) return std::nullopt;
    if (r != rank) others.push_back(figure(x.busy));
  }
  const double mine = figure(me.busy), rest = median_of(others);
  if (mine > o_.factor * rest && mine - rest >= o_.min_gap)
    ++me.above;
  else
    me.above = 0;
  if (me.reported || me.above < o_.steps) return std::nullopt;
  me.reported = true;
  return Straggler{rank, step, mine, rest, {me.busy.begin(), me.busy.end()}};
}

}  // namespace keel::run
