#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>

#include "bench/gemm/check.h"
#include "bench/gemm/shapes.h"
#include "bench/gemm/tiling.h"
#include "common/error.h"
#include "model/config.h"

namespace keel::bench {

TEST(GemmShapes, ParsesValuesListsAndRanges) {
  EXPECT_EQ(parse_dim_spec("4096", "--m"), (std::vector<std::int64_t>{4096}));
  EXPECT_EQ(parse_dim_spec("1,2, 3", "--m"), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_EQ(parse_dim_spec("256:1024:256", "--m"), (std::vector<std::int64_t>{256, 512, 768, 1024}));
  EXPECT_EQ(parse_dim_spec("10:20:7,64", "--m"), (std::vector<std::int64_t>{10, 17, 64}));
  EXPECT_THROW(parse_dim_spec("0", "--m"), Error);
  EXPECT_THROW(parse_dim_spec("-5", "--m"), Error);
  EXPECT_THROW(parse_dim_spec("12a", "--m"), Error);
  EXPECT_THROW(parse_dim_spec("10:5:1", "--m"), Error);
  EXPECT_THROW(parse_dim_spec("1:10", "--m"), Error);
  try {
    parse_dim_spec("0", "--k");
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--k must be positive, got 0");
  }
}

TEST(GemmShapes, RangesListsAndSquares) {
  auto s = shapes_from_ranges({1, 2}, {3}, {4, 5, 6}, Layout::kNT);
  ASSERT_EQ(s.size(), 6u);
  EXPECT_EQ(s[5].m, 2);
  EXPECT_EQ(s[5].k, 6);
  EXPECT_EQ(s[5].layout, Layout::kNT);
  auto l = parse_shape_list("8192x8192x8192, 1024x4096x2048x16", Layout::kNN);
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[1].batch, 16);
  EXPECT_DOUBLE_EQ(l[1].flops(), 2.0 * 1024 * 4096 * 2048 * 16);
  EXPECT_THROW(parse_shape_list("8192x8192", Layout::kNN), Error);
  EXPECT_THROW(parse_shape_list("8x0x8", Layout::kNN), Error);
  EXPECT_EQ(square_shapes({64, 128}, Layout::kTN)[1].n, 128);
  EXPECT_EQ(parse_layout("tn"), Layout::kTN);
  EXPECT_THROW(parse_layout("xx"), Error);
  EXPECT_EQ(parse_gemm_type("e4m3"), GemmType::kFP8);
  EXPECT_THROW(parse_gemm_type("int4"), Error);
}

TEST(GemmShapes, ModelGemmsTakeTrainingLayouts) {
  ModelDims d;
  d.hidden = 2048;
  d.heads = 8;
  d.kv_heads = 2;
  d.head_dim = 128;
  d.experts = 16;
  d.top_k = 1;
  d.expert_width = 2048;
  d.router_width = 256;
  d.vocab = 262272;
  bool lm = false;
  const auto config = config_from_dims(d, &lm);
  EXPECT_TRUE(lm);
  const auto shapes = shapes_from_model(config, 16384, true);
  bool saw_expert = false, saw_lm = false;
  for (const auto& s : shapes) {
    EXPECT_EQ(s.layout, s.pass == "fwd" ? Layout::kNT : s.pass == "bwd_data" ? Layout::kNN : Layout::kTN) << s.name;
    if (s.name == "expert_up_gate" && s.pass == "fwd") {
      saw_expert = true;
      EXPECT_EQ(s.m, 1024);  // 16K tokens, top-1 of 16 experts
      EXPECT_EQ(s.n, 4096);
      EXPECT_EQ(s.k, 2048);
      EXPECT_EQ(s.batch, 16);
    }
    if (s.name == "lm_head" && s.pass == "bwd_weight") {
      saw_lm = true;
      EXPECT_EQ(s.m, 2048);
      EXPECT_EQ(s.n, 262272);
      EXPECT_EQ(s.k, 16384);
    }
  }
  EXPECT_TRUE(saw_expert);
  EXPECT_TRUE(saw_lm);
  ModelDims none;
  none.hidden = 4096;
  EXPECT_THROW(config_from_dims(none, &lm), Error);  // neither --ffn nor --experts
  ModelDims bad = d;
  bad.heads = 3;  // does not divide 2048
  EXPECT_THROW(config_from_dims(bad, &lm), Error);
}

TEST(GemmShapes, GivenDimensionsMustBePositive) {
  // A given 0 or negative dimension used to read as "not given" and take the default.
  auto error = [](ModelDims d) -> std::string {
    bool lm = false;
    try {
      config_from_dims(d, &lm);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  ModelDims base;
  base.hidden = 256;
  base.ffn = 128;
  EXPECT_EQ(error(base), "");
  auto with = [&](std::optional<int> ModelDims::*field, int value) {
    ModelDims d = base;
    d.*field = value;
    return error(d);
  };
  EXPECT_EQ(with(&ModelDims::heads, -2), "--heads must be positive, got -2");
  EXPECT_EQ(with(&ModelDims::head_dim, 0), "--head-dim must be positive, got 0");
  EXPECT_EQ(with(&ModelDims::kv_heads, -7), "--kv-heads must be positive, got -7");
  EXPECT_EQ(with(&ModelDims::hidden, 0), "--hidden must be positive, got 0");
  EXPECT_EQ(with(&ModelDims::ffn, -1), "--ffn must be positive, got -1");
  EXPECT_EQ(with(&ModelDims::experts, 0), "--experts must be positive, got 0");
  EXPECT_EQ(with(&ModelDims::router_width, 0), "--router-width must be positive, got 0");
  ModelDims vocab = base;
  vocab.vocab = -5;
  EXPECT_EQ(error(vocab), "--vocab must be positive, got -5");
  // Expert flags without --experts used to be dropped silently.
  EXPECT_EQ(with(&ModelDims::top_k, 2), "--top-k, --expert-width and --router-width describe experts: add --experts");
  // Left out, the defaults still apply: 128-wide heads, kv_heads = heads, no LM head.
  bool lm = true;
  const model::ModelConfig c = config_from_dims(base, &lm);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.heads, 2);
  EXPECT_EQ(c.kv_heads, 2);
  EXPECT_FALSE(lm);
  // tokens x top_k past int64 (layer_gemms' routing arithmetic would wrap): an error.
  ModelDims moe = base;
  moe.experts = 4;
  moe.top_k = 2;
  const model::ModelConfig mc = config_from_dims(moe, &lm);
  EXPECT_THROW(shapes_from_model(mc, std::numeric_limits<std::int64_t>::max(), false), Error);
  EXPECT_FALSE(shapes_from_model(mc, 64, false).empty());
}

TEST(GemmTiling, WavesAndTileWaste) {
  // NVIDIA's guide: 109 blocks on an A100's 108 SMs take 2 waves.
  TileStats a = tile_stats(109 * 128, 128, 1, 128, 128, 1, 108);
  EXPECT_EQ(a.ctas, 109);
  EXPECT_EQ(a.full_waves, 2);
  EXPECT_NEAR(a.wave_efficiency, 109.0 / 216.0, 1e-12);
  EXPECT_EQ(a.tile_waste, 0);
  // ml-engineering: Llama-3.1-8B's MLP up-projection at 8K tokens over 128x256 tiles is 3584 blocks.
  EXPECT_EQ(tile_stats(8192, 14336, 1, 128, 256, 1, 132).ctas, 3584);
  // Width 10922 over 256-wide tiles: 43 tiles, the last holding 170 of 256 columns.
  TileStats w = tile_stats(16384, 10922, 1, 128, 256, 1, 132);
  EXPECT_EQ(w.tiles_n, 43);
  EXPECT_NEAR(w.tile_waste, 1.0 - 10922.0 / (43 * 256), 1e-12);
  EXPECT_EQ(tile_stats(100, 100, 4, 64, 64, 2, 132).ctas, 4 * 4 * 2);
  EXPECT_EQ(tile_stats(100, 100, 1, 0, 64, 1, 132).ctas, 0);  // unknown tile
}

TEST(GemmCheck, PositionsCoverCornersWithoutRepeats) {
  GemmShape s;
  s.m = 3, s.n = 2, s.k = 5, s.batch = 2;
  auto p = gemm_check_positions(s, 64, 1);
  EXPECT_EQ(p.size(), 12u);  // every element of both batch entries
  s.m = 1000, s.n = 1000, s.batch = 1;
  p = gemm_check_positions(s, 64, 1);
  EXPECT_EQ(p.size(), 64u);
  EXPECT_EQ(p[0], (std::array<std::int64_t, 3>{0, 0, 0}));
  EXPECT_EQ(p[1], (std::array<std::int64_t, 3>{0, 999, 999}));
}

TEST(GemmCheck, ToleranceFollowsTheType) {
  GemmResult r;
  GemmSample smp;
  for (int q = 0; q < 1024; ++q) {
    smp.a.push_back(static_cast<float>((q % 7) + 1) / 4.f);
    smp.b.push_back(static_cast<float>((q % 5) + 1) / 2.f);
  }
  double exact = 0;
  for (int q = 0; q < 1024; ++q) exact += static_cast<double>(smp.a[q]) * smp.b[q];
  smp.got = exact * (1 + 0x1p-9);  // one bf16 rounding
  r.samples = {smp};
  EXPECT_EQ(check_gemm(r, GemmType::kBF16, 1024).wrong, 0);
  EXPECT_EQ(check_gemm(r, GemmType::kFP32, 1024).wrong, 1);  // too far for fp32
  r.samples[0].got = exact + 0.05 * std::fabs(exact) + 1;  // 5% off: wrong in every type
  for (GemmType t : {GemmType::kBF16, GemmType::kFP16, GemmType::kFP8, GemmType::kTF32, GemmType::kFP32})
    EXPECT_EQ(check_gemm(r, t, 1024).wrong, 1) << gemm_type_name(t);
  r.samples[0].got = NAN;
  EXPECT_EQ(check_gemm(r, GemmType::kBF16, 1024).wrong, 1);
  r.scale = 0.125;
  r.samples[0].got = exact * 0.125;
  EXPECT_EQ(check_gemm(r, GemmType::kFP8, 1024).wrong, 0);
}

}  // namespace keel::bench
