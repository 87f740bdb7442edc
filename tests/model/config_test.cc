#include "model/config.h"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "../error_message.h"

namespace keel::model {
namespace {

std::string config_path(const std::string& name) { return std::string(KEEL_SOURCE_DIR) + "/configs/" + name; }

// Writes a YAML file under the test's temp dir and returns its path.
std::string write_yaml(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::temp_directory_path() / "keel_model_config_test";
  std::filesystem::create_directories(dir);
  const auto path = dir / name;
  std::ofstream(path) << text;
  return path.string();
}

const char* kTinyGqa = R"(
vocab_size: 1000
hidden: 512
layers: 4
attention: gqa
heads: 8
kv_heads: 2
ffn_hidden: 1376
)";

std::string load_error(const std::string& name, const std::string& text) {
  const std::string path = write_yaml(name, text);
  return test::error_message<UsageError>([&] { load_model_config(path); });
}

TEST(ModelConfig, LoadsZaya1) {
  const ModelConfig m = load_model_config(config_path("zaya1-8b.yaml"));
  EXPECT_EQ(m.name, "zaya1-8b");
  EXPECT_EQ(m.vocab_size, 262272);
  EXPECT_EQ(m.hidden, 2048);
  EXPECT_EQ(m.layers, 40);
  EXPECT_EQ(m.attention, AttentionKind::kCca);
  EXPECT_EQ(m.heads, 8);
  EXPECT_EQ(m.kv_heads, 2);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.cca_q_dim, 1024);
  EXPECT_EQ(m.cca_k_dim, 256);
  EXPECT_EQ(m.cca_v_dim, 256);
  EXPECT_EQ(m.experts, 16);
  EXPECT_EQ(m.top_k, 1);
  EXPECT_EQ(m.expert_hidden, 2048);
  EXPECT_EQ(m.router_hidden, 256);
  EXPECT_TRUE(m.router_skip_expert);
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_DOUBLE_EQ(m.rope_fraction, 0.5);
  EXPECT_EQ(moe_layer_count(m), 40);
}

TEST(ModelConfig, LoadsEveryShippedConfig) {
  for (const auto& e : std::filesystem::directory_iterator(std::string(KEEL_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    SCOPED_TRACE(e.path().string());
    EXPECT_NO_THROW(load_model_config(e.path().string()));
  }
}

TEST(ModelConfig, DefaultsFollowFromOtherKeys) {
  const ModelConfig m = load_model_config(write_yaml("defaults.yaml", "vocab_size: 100\nhidden: 256\nlayers: 2\n"
                                                                      "attention: mha\nheads: 4\nffn_hidden: 512\n"));
  EXPECT_EQ(m.kv_heads, 4);
  EXPECT_EQ(m.head_dim, 64);
  EXPECT_EQ(m.name, "defaults");  // the file stem when no name is given
}

TEST(ModelConfig, LayerAttentionPatternRepeats) {
  const ModelConfig m = load_model_config(config_path("lasp2-hybrid-1b.yaml"));
  EXPECT_EQ(attention_layer_count(m, AttentionKind::kLinear), 12);
  EXPECT_EQ(attention_layer_count(m, AttentionKind::kGqa), 4);
  EXPECT_EQ(layer_attention_kind(m, 3), AttentionKind::kGqa);
  EXPECT_EQ(layer_attention_kind(m, 4), AttentionKind::kLinear);
}

TEST(ModelConfig, LinearAttentionKeys) {
  const ModelConfig d = load_model_config(config_path("lasp2-hybrid-1b.yaml"));
  EXPECT_EQ(d.linear_feature, "identity");
  EXPECT_EQ(d.linear_decay, "none");
  const std::string base = kTinyGqa;
  const ModelConfig m = load_model_config(
      write_yaml("lin.yaml", base + "layer_attention: [linear, gqa]\nlinear_feature: elu1\nlinear_decay: retnet\n"));
  EXPECT_EQ(m.linear_feature, "elu1");
  EXPECT_EQ(m.linear_decay, "retnet");
  std::string e = load_error("feat.yaml", base + "linear_feature: relu\n");
  EXPECT_NE(e.find("key 'linear_feature': unknown feature map 'relu' (choose identity or elu1)"), std::string::npos) << e;
  e = load_error("decay.yaml", base + "linear_decay: alibi\n");
  EXPECT_NE(e.find("key 'linear_decay': unknown decay 'alibi' (choose none or retnet)"), std::string::npos) << e;
}

TEST(ModelConfig, MoeLayerPlacement) {
  ModelConfig m = load_model_config(config_path("mixtral-8x7b.yaml"));
  m.moe_layer_interval = 2;
  m.first_dense_layers = 1;
  m.ffn_hidden = 14336;
  EXPECT_FALSE(is_moe_layer(m, 0));
  EXPECT_TRUE(is_moe_layer(m, 1));
  EXPECT_FALSE(is_moe_layer(m, 2));
  EXPECT_TRUE(is_moe_layer(m, 3));
  EXPECT_EQ(moe_layer_count(m), 16);
  EXPECT_NO_THROW(validate(m));
  m.ffn_hidden = 0;  // dense layers now need a width
  EXPECT_THROW(validate(m), UsageError);
}

TEST(ModelConfig, RepeatedKeysAndSizesBeyondAnyModelAreErrors) {
  const std::string base = kTinyGqa;
  std::string e = load_error("dup.yaml", base + "hidden: 256\n");
  EXPECT_NE(e.find("dup.yaml: key 'hidden' appears twice (lines 3 and 9)"), std::string::npos) << e;
  e = load_error("vocab.yaml", "vocab_size: 4611686018427387904\nhidden: 512\nlayers: 4\nheads: 8\nffn_hidden: 64\n");
  EXPECT_NE(e.find("key 'vocab_size' (4611686018427387904) must be at most 2147483647"), std::string::npos) << e;
  e = load_error("layers.yaml", "vocab_size: 1000\nhidden: 512\nlayers: 2147483647\nheads: 8\nffn_hidden: 64\n");
  EXPECT_NE(e.find("key 'layers' (2147483647) must be at most 65536"), std::string::npos) << e;
  e = load_error("experts.yaml", base + "experts: 2147483647\ntop_k: 1\nexpert_hidden: 64\n");
  EXPECT_NE(e.find("key 'experts' (2147483647) must be at most 65536"), std::string::npos) << e;
  e = load_error("heads.yaml", "vocab_size: 1000\nhidden: 512\nlayers: 2\nheads: 65536\nhead_dim: 65536\n"
                               "ffn_hidden: 64\n");
  EXPECT_NE(e.find("key 'heads x head_dim' (4294967296) must be at most 16777216"), std::string::npos) << e;
}

TEST(ModelConfig, NonFiniteNumbersAreErrors) {
  const std::string base = kTinyGqa;
  std::string e = load_error("eps.yaml", base + "norm_eps: .nan\n");
  EXPECT_NE(e.find("key 'norm_eps' (nan) must be a positive number"), std::string::npos) << e;
  e = load_error("eps_inf.yaml", base + "norm_eps: .inf\n");
  EXPECT_NE(e.find("key 'norm_eps' (inf) must be a positive number"), std::string::npos) << e;
  e = load_error("base.yaml", base + "rope_base: .nan\n");
  EXPECT_NE(e.find("key 'rope_base' (nan) must be a finite number above 1"), std::string::npos) << e;
  e = load_error("base1.yaml", base + "rope_base: 1\n");
  EXPECT_NE(e.find("key 'rope_base' (1) must be a finite number above 1"), std::string::npos) << e;
  e = load_error("frac.yaml", base + "rope_fraction: .nan\n");
  EXPECT_NE(e.find("key 'rope_fraction' (nan) must be in [0, 1]"), std::string::npos) << e;
  EXPECT_EQ(load_error("norope.yaml", base + "rope_fraction: 0\nrope_base: 1\n"), "");  // no rotary channels
}

TEST(ModelConfig, BadConfigsNameTheKey) {
  const std::string base = kTinyGqa;
  EXPECT_NO_THROW(load_model_config(write_yaml("ok.yaml", base)));
  std::string e = load_error("unknown.yaml", base + "hidden_size: 4\n");
  EXPECT_NE(e.find("unknown key 'hidden_size'"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown.yaml"), std::string::npos) << e;
  EXPECT_NE(e.find("line 9"), std::string::npos) << e;

  e = load_error("heads.yaml", "vocab_size: 1000\nhidden: 500\nlayers: 2\nheads: 8\nkv_heads: 2\nffn_hidden: 64\n");
  EXPECT_NE(e.find("'heads' (8) does not divide 'hidden' (500)"), std::string::npos) << e;

  e = load_error("kv.yaml", "vocab_size: 1000\nhidden: 512\nlayers: 2\nheads: 8\nkv_heads: 3\nffn_hidden: 64\n");
  EXPECT_NE(e.find("'kv_heads' (3) does not divide 'heads' (8)"), std::string::npos) << e;

  e = load_error("topk.yaml", "vocab_size: 1000\nhidden: 512\nlayers: 2\nheads: 8\nexperts: 4\ntop_k: 5\n"
                              "expert_hidden: 64\n");
  EXPECT_NE(e.find("'top_k' (5) is larger than 'experts' (4)"), std::string::npos) << e;

  e = load_error("type.yaml", base + "tied_embeddings: sometimes\n");
  EXPECT_NE(e.find("'tied_embeddings'"), std::string::npos) << e;

  e = load_error("int.yaml", "vocab_size: 1000\nhidden: wide\nlayers: 2\nheads: 8\nffn_hidden: 64\n");
  EXPECT_NE(e.find("key 'hidden' (line 2) must be an integer, got 'wide'"), std::string::npos) << e;

  e = load_error("kind.yaml", base + "layer_attention: [linear, softmax]\n");
  EXPECT_NE(e.find("unknown attention kind 'softmax'"), std::string::npos) << e;

  e = load_error("pattern.yaml", base + "layer_attention: [linear, linear, gqa]\n");
  EXPECT_NE(e.find("'layer_attention' has 3 entries"), std::string::npos) << e;

  e = load_error("cca.yaml", "vocab_size: 1000\nhidden: 512\nlayers: 2\nattention: cca\nheads: 4\nkv_heads: 2\n"
                             "head_dim: 64\ncca_q_dim: 200\ncca_k_dim: 128\ncca_v_dim: 128\ncca_conv_width: 2\n"
                             "cca_group_conv_width: 2\nffn_hidden: 64\n");
  EXPECT_NE(e.find("'cca_q_dim' (200) must equal heads*head_dim (256)"), std::string::npos) << e;

  e = load_error("dense.yaml", "vocab_size: 1000\nhidden: 512\nlayers: 2\nheads: 8\n");
  EXPECT_NE(e.find("'ffn_hidden' must be positive"), std::string::npos) << e;

  e = load_error("missing.yaml", "- a\n- b\n");
  EXPECT_NE(e.find("must be a YAML mapping"), std::string::npos) << e;

  EXPECT_EQ(test::error_message<UsageError>([] { load_model_config("/nonexistent/model.yaml"); }, "(no error)"),
            "cannot read /nonexistent/model.yaml: No such file or directory");
}

// Issue 34: a model YAML that is no file was read through YAML::LoadFile, whose error for a
// directory ("basic_filebuf::underflow error reading the file: Is a directory") named no path,
// and /dev/zero was read until memory ran out. Both are refused, by name, before any read.
TEST(ModelConfig, NoFileIsRefusedByNameBeforeReading) {
  const auto dir = std::filesystem::temp_directory_path() / "keel_model_config_test_dir";
  std::filesystem::create_directories(dir);
  for (auto load : {+[](const std::string& p) { load_model_config(p); },
                    +[](const std::string& p) { load_model_or_train_config(p); }}) {
    EXPECT_EQ(test::error_message<UsageError>([&] { load(dir.string()); }, "(no error)"),
              "cannot read " + dir.string() + ": it is a directory, not a config file");
    EXPECT_EQ(test::error_message<UsageError>([&] { load("/dev/zero"); }, "(no error)"),
              "cannot read /dev/zero: it is a character device, not a config file");
  }
}

// Issue 34: the model's name goes into every checkpoint's JSON. Without a `name` key it is the
// file's name, which need not be UTF-8: refused at load, not at the first checkpoint commit.
TEST(ModelConfig, NameMustBeUtf8) {
  const std::string bad_name = write_yaml("m\xff.yaml", kTinyGqa);
  EXPECT_EQ(test::error_message<UsageError>([&] { load_model_config(bad_name); }, "(no error)"),
            bad_name + ": the model's name, taken from the file name 'm\\xff' as there is no key 'name', is not "
                       "valid UTF-8 (byte 0xff at offset 1): add a key 'name'");
  EXPECT_EQ(load_model_config(write_yaml("m\xff" "2.yaml", std::string(kTinyGqa) + "name: ok\n")).name, "ok");
  const std::string latin1 = write_yaml("latin1.yaml", std::string(kTinyGqa) + "name: caf\xe9\n");
  EXPECT_EQ(test::error_message<UsageError>([&] { load_model_config(latin1); }, "(no error)"),
            latin1 + ": key 'name' (line 9) is not valid UTF-8 (byte 0xe9 at offset 3 starts no valid character); "
                     "configs are stored in checkpoints as JSON, which needs UTF-8");
}

// model_yaml is parse_model_config's inverse: every key, the sliding ones included, comes back
// exactly (doubles too), for every shipped config and one that sets every key off its default.
TEST(ModelConfig, SerializedYamlParsesBackToTheSameConfig) {
  auto round_trip = [](const ModelConfig& m) {
    return parse_model_config(YAML::Load(model_yaml(m)), "(unnamed)", "round trip");
  };
  int shipped = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(KEEL_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    const ModelConfig m = load_model_config(e.path().string());
    EXPECT_EQ(round_trip(m), m) << e.path() << "\n" << model_yaml(m);
    ++shipped;
  }
  EXPECT_GE(shipped, 6);
  ModelConfig m = load_model_config(config_path("zaya1-tiny.yaml"));
  m.name = "odd: \"name\" # with YAML's specials";
  m.layers = 4;
  m.layer_attention = {AttentionKind::kCca, AttentionKind::kCca};
  m.linear_chunk = 64;
  m.moe_layer_interval = 1;
  m.tied_embeddings = false;
  m.rope_fraction = 0.3;
  m.rope_base = 5e6;
  m.norm_eps = 1.0 / 3.0e5;  // no short decimal form
  m.max_seq_len = 131072;
  m.layer_sliding = {true, false};
  m.sliding_window = 17;
  m.sliding_rope_base = 12345.678;
  m.sliding_rope_fraction = 0.75;
  validate(m);
  const ModelConfig back = round_trip(m);
  EXPECT_EQ(back, m) << model_yaml(m);
  EXPECT_EQ(back.norm_eps, m.norm_eps);
  EXPECT_EQ(back.layer_sliding, m.layer_sliding);
  EXPECT_EQ(back.sliding_rope_fraction, 0.75);
  // The unset sliding keys stay unset (a negative sliding_rope_fraction is not a YAML value).
  m.layer_sliding.clear();
  m.sliding_window = 0;
  m.sliding_rope_base = 0;
  m.sliding_rope_fraction = -1;
  EXPECT_EQ(round_trip(m), m) << model_yaml(m);
}

// model_key_values compares what each layer computes: the same network written two ways
// (a pattern or one entry per layer; a sliding RoPE base given or inherited) is the same model.
TEST(ModelConfig, KeyValuesCompareWhatTheLayersCompute) {
  ModelConfig a = load_model_config(config_path("zaya1-tiny.yaml"));
  a.layers = 4;
  a.layer_sliding = {false, true};
  a.sliding_window = 8;
  a.sliding_rope_base = a.rope_base;
  ModelConfig b = a;
  b.layer_sliding = {false, true, false, true};
  b.sliding_rope_base = 0;
  b.layer_attention = {AttentionKind::kCca};
  EXPECT_EQ(model_key_values(a), model_key_values(b));
  b.sliding_rope_base = 5e6;
  const auto ka = model_key_values(a), kb = model_key_values(b);
  ASSERT_EQ(ka.size(), kb.size());
  std::string differs;
  for (std::size_t i = 0; i < ka.size(); ++i)
    if (ka[i].second != kb[i].second) differs += ka[i].first + " " + ka[i].second + " -> " + kb[i].second + ";";
  EXPECT_EQ(differs, "sliding_rope_base 10000 -> 5000000;");
  for (const auto& [key, value] : ka) EXPECT_NE(key, "name");
}

}  // namespace
}  // namespace keel::model
