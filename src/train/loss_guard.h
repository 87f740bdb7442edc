// The loss-spike guard of keel train (fault.loss_spike_sigma k, fault.loss_spike_window W): a
// step's loss is a spike when it exceeds mean + k x std of the previous W steps' losses (the
// population standard deviation of the window), once the window holds W losses. A spike is
// never recorded, so the window holds the steps that trained. k = 0: off.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace keel::train {

class LossGuard {
 public:
  LossGuard() = default;  // off
  LossGuard(double sigma, int window);

  bool enabled() const { return sigma_ > 0; }
  // Whether `loss` is a spike (always false while off, or while the window holds fewer than W).
  bool is_spike(double loss) const;
  // Adds the loss of a step that trained, dropping the oldest beyond W.
  void record(double loss);
  // "step S: loss X is a spike (> mean M + k x std D over the last W steps)".
  std::string spike_message(std::int64_t step, double loss) const;
  double mean() const;
  double stddev() const;
  // The window, oldest first (a checkpoint saves it), and its restore: the newest W kept.
  std::vector<double> window() const { return {window_.begin(), window_.end()}; }
  void restore(const std::vector<double>& losses);

 private:
  double sigma_ = 0;
  std::size_t size_ = 50;
  std::deque<double> window_;
};

}  // namespace keel::train
