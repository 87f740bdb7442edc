// Newton-Schulz orthogonalization of one whole matrix, the core of Muon: an approximation of
// the polar factor U V^T of G = U S V^T using only GEMMs (cblas_sgemm, fp32).
//
// The quintic iteration of the published Muon implementation (K. Jordan et al.,
// https://github.com/KellerJordan/Muon, muon.py `zeropower_via_newtonschulz5`, and
// https://kellerjordan.github.io/posts/muon/): coefficients (a, b, c) = (3.4445, -4.7750,
// 2.0315), chosen to maximize the slope at zero rather than to converge, so 5 iterations map
// every singular value that is not tiny into about [0.68, 1.21] (not exactly 1):
//   X_0 = G / (||G||_F + eps)            (spectral norm <= 1), G transposed first when tall
//   repeat: A = X X^T;  B = b A + c A A;  X = a X + B X
//   (transposed back when G was tall)
// Each singular value s goes through p(s) = a s + b s^3 + c s^5 per iteration; the singular
// vectors are unchanged. Working on the wide orientation keeps A at min(m, n)^2.
// This code is written from the equations above; it does not copy the reference.
//
// Distributed use: this function needs the whole matrix and nothing else, so under ZeRO-1 the
// rank that owns a matrix runs it alone (docs/optim.md).
#pragma once

#include <cstdint>

namespace keel::optim {

struct NsCoefficients {
  double a = 3.4445, b = -4.7750, c = 2.0315;
};

// Floats of scratch newton_schulz() needs for an m x n matrix: 2 s l + 2 s^2 with
// s = min(m, n), l = max(m, n).
std::int64_t newton_schulz_scratch_floats(std::int64_t rows, std::int64_t cols);

// out [rows, cols] = NS_steps(g [rows, cols]). out may alias g. scratch holds at least
// newton_schulz_scratch_floats(rows, cols) floats. Throws on bad sizes or steps < 0.
// A zero matrix gives a zero result (the eps keeps the division finite).
void newton_schulz(const float* g, float* out, std::int64_t rows, std::int64_t cols, float* scratch, int steps = 5,
                   const NsCoefficients& coeffs = {}, float eps = 1e-7f);

// FLOPs of newton_schulz on one m x n matrix (s = min, l = max): steps * (4 s^2 l + 2 s^3),
// used to balance matrices over ranks.
double newton_schulz_flops(std::int64_t rows, std::int64_t cols, int steps = 5);

}  // namespace keel::optim
