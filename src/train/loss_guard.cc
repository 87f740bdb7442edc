#include "train/loss_guard.h"

#include <fmt/format.h>

#include <cmath>

namespace keel::train {

LossGuard::LossGuard(double sigma, int window) : sigma_(sigma), size_(window > 0 ? static_cast<std::size_t>(window) : 1) {}

double LossGuard::mean() const {
  if (window_.empty()) return 0;
  double sum = 0;
  for (double x : window_) sum += x;
  return sum / static_cast<double>(window_.size());
}

double LossGuard::stddev() const {
  if (window_.empty()) return 0;
  const double m = mean();
  double sum = 0;
  for (double x : window_) sum += (x - m) * (x - m);
  return std::sqrt(sum / static_cast<double>(window_.size()));
}

bool LossGuard::is_spike(double loss) const {
  if (!enabled() || window_.size() < size_) return false;
  return loss > mean() + sigma_ * stddev();
}

void LossGuard::record(double loss) {
  window_.push_back(loss);
  while (window_.size() > size_) window_.pop_front();
}

std::string LossGuard::spike_message(std::int64_t step, double loss) const {
  return fmt::format("step {}: loss {:.6g} is a spike (> mean {:.6g} + {:g} x std {:.6g} over the last {} steps)", step,
                     loss, mean(), sigma_, stddev(), window_.size());
}

void LossGuard::restore(const std::vector<double>& losses) {
  window_.assign(losses.begin(), losses.end());
  while (window_.size() > size_) window_.pop_front();
}

}  // namespace keel::train
