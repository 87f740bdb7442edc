// ZAYA1's config.json both ways (src/model/released_config.*): keel's export reads back as the
// same model under both layouts, transformers' ZayaConfig defaults are the released ZAYA1-8B
// (configs/zaya1-8b.yaml), every supported key lands in the model, and every key keel cannot
// represent is one error naming it.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "model/config.h"
#include "model/released_config.h"
#include "../error_message.h"
#include "release_like.h"

namespace keel::model::released {
namespace {

using json = nlohmann::json;

ModelConfig config(const char* name) { return load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + name); }

ModelConfig read(const json& j, Names names = Names::kZaya1) {
  return model_of_hf_config(j, names, "release", "rel/config.json");
}

std::string error_of(const json& j, Names names = Names::kZaya1) {
  return test::error_message<UsageError>([&] { read(j, names); }, "(no error)");
}

// What transformers 5.24 writes for ZayaConfig() (save_pretrained: every field at its default,
// the release's), with the stray top-level rope_type the Hub's ZAYA1-8B config.json has.
json transformers_default() {
  return json::parse(R"({
    "architectures": ["ZayaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 2,
    "cca_time0": 2, "cca_time1": 2, "dtype": "bfloat16", "eos_token_id": 106, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "lm_head_bias": false,
    "max_position_embeddings": 131072, "model_type": "zaya", "moe_intermediate_size": 2048,
    "num_attention_heads": 8, "num_experts": 16, "num_experts_per_tok": 1, "num_hidden_layers": 40,
    "num_key_value_heads": 2, "output_router_logits": false, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_type": "default",
      "hybrid": {"partial_rotary_factor": 0.5, "rope_theta": 5000000.0, "rope_type": "default"},
      "hybrid_sliding": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"}},
    "router_hidden_size": 256, "sliding_window": null, "tie_word_embeddings": true,
    "transformers_version": "5.24.0", "use_cache": true, "vocab_size": 262272})");
}

// A small model in transformers' keys (4 layers), for the per-key tests.
json tiny() {
  json j = transformers_default();
  j.merge_patch(json::parse(R"({"vocab_size": 264, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 64, "moe_intermediate_size": 256, "num_experts": 4,
    "router_hidden_size": 64, "max_position_embeddings": 512})"));
  j["layer_types"] = {"hybrid", "hybrid", "hybrid", "hybrid"};
  return j;
}

std::string differences(const ModelConfig& a, const ModelConfig& b) {
  const auto ka = model_key_values(a), kb = model_key_values(b);
  std::string out;
  for (std::size_t i = 0; i < ka.size(); ++i)
    if (ka[i].second != kb[i].second) out += ka[i].first + ": " + ka[i].second + " vs " + kb[i].second + "; ";
  return out;
}

// A zaya1-tiny with sliding layers, its own RoPE on them, and an untied head.
ModelConfig sliding_tiny() { return test::release_like_tiny("zaya1-tiny", 8, 4096); }

TEST(ReleasedConfig, ExportThenImportGivesTheModelBack) {
  for (const ModelConfig& m : {config("zaya1-tiny.yaml"), config("zaya1-8b.yaml"), sliding_tiny()})
    for (Names names : {Names::kZaya1, Names::kZaya1Alternating}) {
      SCOPED_TRACE(m.name + " " + to_string(names));
      if (names == Names::kZaya1Alternating && any_sliding_layer(m)) {
        const std::string e = test::error_message<UsageError>([&] { hf_config(m, names, "float32", {}); });
        EXPECT_NE(e.find("has sliding-window layers, which keel does not write in this layout's config: use --names "
                         "zaya1"),
                  std::string::npos)
            << e;
        continue;
      }
      const json written = json::parse(hf_config(m, names, "bfloat16", {}).dump(2));  // through the text
      const ModelConfig back = model_of_hf_config(written, names, m.name, "config.json");
      EXPECT_EQ(back, m) << model_yaml(back) << "\n---\n" << model_yaml(m);
    }
  // Transformers' keys for the sliding model: layer types, the window, RoPE per type.
  const json j = hf_config(sliding_tiny(), Names::kZaya1, "float32", {});
  EXPECT_EQ(j["layer_types"], json({"hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"}));
  EXPECT_EQ(j["sliding_window"], 8);
  EXPECT_EQ(j["rope_parameters"]["hybrid"]["rope_theta"], 5e6);
  EXPECT_EQ(j["rope_parameters"]["hybrid_sliding"]["rope_theta"], 1e4);
  EXPECT_EQ(j["rope_parameters"]["hybrid_sliding"]["partial_rotary_factor"], 1.0);
  EXPECT_FALSE(hf_config(config("zaya1-tiny.yaml"), Names::kZaya1, "float32", {})["rope_parameters"].contains("hybrid_sliding"));
}

// configs/zaya1-8b.yaml describes the released model: transformers' defaults, and so an empty
// config.json.
TEST(ReleasedConfig, TransformersDefaultsAreConfigsZaya1_8b) {
  const ModelConfig want = config("zaya1-8b.yaml");
  EXPECT_EQ(differences(read(transformers_default()), want), "");
  EXPECT_EQ(differences(read(json::object()), want), "");
  EXPECT_EQ(read(transformers_default()).name, "release");
  EXPECT_EQ(want.rope_base, 5e6);
  EXPECT_EQ(want.max_seq_len, 131072);
}

TEST(ReleasedConfig, EverySupportedKeyLandsInTheModel) {
  ModelConfig m = read(tiny());
  EXPECT_EQ(m.vocab_size, 264);
  EXPECT_EQ(m.hidden, 256);
  EXPECT_EQ(m.layers, 4);
  EXPECT_EQ(m.heads, 4);
  EXPECT_EQ(m.kv_heads, 2);
  EXPECT_EQ(m.head_dim, 64);
  EXPECT_EQ(m.cca_q_dim, 256);
  EXPECT_EQ(m.cca_k_dim, 128);
  EXPECT_EQ(m.cca_v_dim, 128);
  EXPECT_EQ(m.expert_hidden, 256);
  EXPECT_EQ(m.experts, 4);
  EXPECT_EQ(m.top_k, 1);
  EXPECT_TRUE(m.router_skip_expert);
  EXPECT_EQ(m.router_hidden, 64);
  EXPECT_EQ(m.max_seq_len, 512);
  EXPECT_TRUE(m.layer_sliding.empty());
  EXPECT_EQ(m.sliding_window, 0);

  json j = tiny();
  j["rope_parameters"]["hybrid"] = {{"rope_type", "default"}, {"rope_theta", 250000.0}, {"partial_rotary_factor", 0.25}};
  j["rms_norm_eps"] = 1e-6;
  j["tie_word_embeddings"] = false;
  j["cca_time0"] = 3;
  j["cca_time1"] = 4;
  m = read(j);
  EXPECT_EQ(m.rope_base, 250000.0);
  EXPECT_EQ(m.rope_fraction, 0.25);
  EXPECT_EQ(m.norm_eps, 1e-6);
  EXPECT_FALSE(m.tied_embeddings);
  EXPECT_EQ(m.cca_conv_width, 3);
  EXPECT_EQ(m.cca_group_conv_width, 4);

  // Sliding layers: the per-layer list becomes the shortest repeating pattern, with the window
  // and the hybrid_sliding RoPE (kept only where it differs from the full layers').
  j = tiny();
  j["layer_types"] = {"hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"};
  j["sliding_window"] = 32;
  m = read(j);
  EXPECT_EQ(m.layer_sliding, std::vector<bool>({false, true}));
  EXPECT_EQ(m.sliding_window, 32);
  EXPECT_EQ(m.rope_base, 5e6);
  EXPECT_EQ(m.sliding_rope_base, 1e4);
  EXPECT_EQ(m.sliding_rope_fraction, -1);  // 0.5, as the full layers
  EXPECT_EQ(layer_rope_base(m, 1), 1e4);
  EXPECT_EQ(attention_window(m, 3), 32);
  EXPECT_EQ(attention_window(m, 2), 0);
  j["layer_types"] = {"hybrid", "hybrid", "hybrid_sliding", "hybrid"};
  j["rope_parameters"]["hybrid_sliding"]["partial_rotary_factor"] = 1.0;
  m = read(j);
  EXPECT_EQ(m.layer_sliding, std::vector<bool>({false, false, true, false}));
  EXPECT_EQ(layer_rope_fraction(m, 2), 1.0);
  EXPECT_EQ(layer_rope_fraction(m, 1), 0.5);
  j["layer_types"] = {"hybrid_sliding", "hybrid_sliding", "hybrid_sliding", "hybrid_sliding"};  // every layer
  m = read(j);
  EXPECT_EQ(m.layer_sliding, std::vector<bool>({true}));
  EXPECT_EQ(m.rope_base, 1e4);
  EXPECT_EQ(m.rope_fraction, 1.0);

  // Older configs: RoPE in top-level keys (no rope_parameters), or per-type entries that leave
  // a key to them; the fork's keys agreeing with transformers'.
  j = tiny();
  j.erase("rope_parameters");
  j["rope_theta"] = 10000;
  j["partial_rotary_factor"] = 0.5;
  j["norm_epsilon"] = 1e-5;
  j["num_query_groups"] = 2;
  j["ffn_hidden_size"] = 512;
  j["zaya_mlp_expansion"] = 64;
  j["zaya_use_mod"] = true;
  m = read(j);
  EXPECT_EQ(m.rope_base, 1e4);
  EXPECT_EQ(m.rope_fraction, 0.5);
  j = tiny();
  j["rope_parameters"] = {{"hybrid", {{"rope_theta", 1e6}}}};
  EXPECT_EQ(read(j).rope_fraction, 1.0);  // transformers' default for a missing partial_rotary_factor
  j["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(read(j).rope_fraction, 0.5);
  EXPECT_EQ(read(j).rope_base, 1e6);
}

struct Refused {
  const char* name;
  const char* patch;     // merged into tiny() (null removes a key)
  const char* expected;  // in the error, after "rel/config.json: "
};

class ReleasedConfigRefuses : public ::testing::TestWithParam<Refused> {};

TEST_P(ReleasedConfigRefuses, OneErrorNamingTheKey) {
  json j = tiny();
  j.merge_patch(json::parse(GetParam().patch));
  const std::string e = error_of(j);
  EXPECT_EQ(e.rfind(std::string("rel/config.json: ") + GetParam().expected, 0), 0u) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

const Refused kRefused[] = {
    {"yarn", R"({"rope_parameters": {"hybrid": {"rope_type": "yarn", "factor": 4.0}}})",
     "'rope_parameters.hybrid.rope_type' is \"yarn\": keel runs the default RoPE only"},
    {"rope_factor", R"({"rope_parameters": {"hybrid": {"factor": 4.0}}})",
     "'rope_parameters.hybrid.factor' is a RoPE parameter keel does not have"},
    {"stray_rope_type", R"({"rope_parameters": {"rope_type": "linear"}})",
     "'rope_parameters.rope_type' is \"linear\": keel runs the default RoPE only"},
    {"flat_rope", R"({"rope_parameters": {"rope_theta": 10000.0}})",
     "'rope_parameters.rope_theta' is not a layer type (keel reads hybrid and hybrid_sliding)"},
    {"rope_scaling", R"({"rope_scaling": {"type": "linear", "factor": 2.0}})",
     "'rope_scaling' is {\"factor\":2.0,\"type\":\"linear\"}: keel runs the default RoPE only"},
    {"rope_theta_disagrees", R"({"rope_theta": 10000})",
     "'rope_theta' is 10000: rope_parameters.hybrid.rope_theta says 5000000"},
    {"attention_bias", R"({"attention_bias": true})", "'attention_bias' is true: keel's attention projections have no biases"},
    {"lm_head_bias", R"({"lm_head_bias": true})", "'lm_head_bias' is true: keel's LM head has no bias"},
    {"gelu", R"({"hidden_act": "gelu"})", "'hidden_act' is \"gelu\": keel's experts are SwiGLU (a SiLU gate)"},
    {"top2", R"({"num_experts_per_tok": 2})", "'num_experts_per_tok' is 2: keel's ZAYA1 routes top-1"},
    {"dropout", R"({"attention_dropout": 0.1})", "'attention_dropout' is 0.1: keel has no attention dropout"},
    {"model_type", R"({"model_type": "llama"})", "'model_type' is \"llama\": not a ZAYA1 config"},
    {"layer_type", R"({"layer_types": ["hybrid", "full_attention", "hybrid", "hybrid"]})",
     "'layer_types[1]' is \"full_attention\": keel has the layer types hybrid and hybrid_sliding"},
    {"layer_count", R"({"num_hidden_layers": 3})", "'layer_types' must list num_hidden_layers (3) layer types"},
    {"no_window", R"({"layer_types": ["hybrid", "hybrid_sliding", "hybrid", "hybrid"]})",
     "'sliding_window' must be a positive integer: layer_types has hybrid_sliding layers"},
    {"no_sliding_rope", R"({"layer_types": ["hybrid", "hybrid_sliding", "hybrid", "hybrid"], "sliding_window": 4,
       "rope_parameters": {"hybrid_sliding": null}})",
     "'rope_parameters' has no 'hybrid_sliding' entry for the hybrid_sliding layers"},
    {"no_skip_class", R"({"zaya_use_mod": false})", "'zaya_use_mod' is false: the zaya1 layout always has the skip class"},
    {"no_eda", R"({"zaya_use_eda": false})", "'zaya_use_eda' is false: keel's router always carries"},
    {"kv_groups", R"({"num_query_groups": 4})", "'num_query_groups' is 4: num_key_value_heads says 2"},
    {"ffn", R"({"ffn_hidden_size": 256})", "'ffn_hidden_size' is 256: 2 x moe_intermediate_size says 512"},
    {"string_width", R"({"hidden_size": "big"})", "'hidden_size' is \"big\": must be an integer"},
    {"unknown_key", R"({"quantization_config": {"bits": 4}})",
     "'quantization_config' is not a key keel knows to leave the computation alone"},
    {"remote_code", R"({"auto_map": {"AutoModel": "x.Y"}})", "'auto_map' is not a key keel knows"},
    {"kv_not_dividing", R"({"num_key_value_heads": 3})",
     "describes a model keel cannot run: key 'kv_heads' (3) does not divide 'heads' (4)"},
};

INSTANTIATE_TEST_SUITE_P(Keys, ReleasedConfigRefuses, ::testing::ValuesIn(kRefused),
                         [](const auto& info) { return std::string(info.param.name); });

// The legacy alternating-layer config (branch zaya1-legacy) in its per-stage list form.
TEST(ReleasedConfig, ReadsTheLegacyAlternatingConfig) {
  json j = {{"model_type", "zaya"}, {"vocab_size", 264}, {"hidden_size", 256}, {"num_hidden_layers", 4},
            {"num_attention_heads", 4}, {"rope_theta", 5000000}, {"partial_rotary_factor", 0.5},
            {"norm_epsilon", 1e-5}, {"max_position_embeddings", 1024}, {"rope_scaling", nullptr},
            {"zaya_use_mod", true}, {"zaya_use_eda", true}, {"cca", true}, {"activation_func", "swiglu"},
            {"apply_rope_fusion", true}, {"bias_activation_fusion", true}, {"sliding_window", nullptr},
            {"_attn_implementation", "eager"}, {"num_key_value_heads", 2}};
  j["cca_num_q_heads"] = {4, 0, 4, 0};
  j["num_query_groups_list"] = {2, 0, 2, 0};
  j["ffn_hidden_size_list"] = {0, 512, 0, 512};
  j["zaya_mlp_expansion"] = {0, 64, 0, 64};
  j["zaya_layers"] = {"a", 4, "a", 4};
  ModelConfig m = read(j, Names::kZaya1Alternating);
  EXPECT_EQ(m.layers, 2);
  EXPECT_EQ(m.heads, 4);
  EXPECT_EQ(m.kv_heads, 2);
  EXPECT_EQ(m.head_dim, 64);  // hidden_size / num_attention_heads
  EXPECT_EQ(m.experts, 4);
  EXPECT_EQ(m.expert_hidden, 256);
  EXPECT_EQ(m.router_hidden, 64);
  EXPECT_EQ(m.rope_base, 5e6);
  EXPECT_EQ(m.max_seq_len, 1024);
  ModelConfig want = config("zaya1-tiny.yaml");
  want.vocab_size = 264;
  want.rope_base = 5e6;
  want.max_seq_len = 1024;
  EXPECT_EQ(differences(m, want), "");

  auto refused = [&](const char* patch) {
    json k = j;
    k.merge_patch(json::parse(patch));
    return error_of(k, Names::kZaya1Alternating);
  };
  EXPECT_EQ(refused(R"({"cca_num_q_heads": [4, 0, 8, 0]})"),
            "rel/config.json: 'cca_num_q_heads[2]' is 8: stage 0 has 4: keel's layers are all alike");
  EXPECT_EQ(refused(R"({"num_query_groups": 1})"),
            "rel/config.json: 'num_query_groups_list' is 2, but num_query_groups says 1");
  EXPECT_EQ(refused(R"({"swa_layers": [4096, 0, 0, 0]})"),
            "rel/config.json: 'swa_layers' is [4096,0,0,0]: keel does not read this layout's sliding windows (use "
            "--names zaya1)");
  EXPECT_EQ(refused(R"({"num_hidden_layers": 3, "zaya_layers": null, "cca_num_q_heads": 4, "num_query_groups_list": null,
                        "ffn_hidden_size_list": null, "zaya_mlp_expansion": 64})"),
            "rel/config.json: 'num_hidden_layers' is 3: must be even, the layout alternates attention and MoE stages");
  EXPECT_EQ(refused(R"({"cca_num_q_heads": null})"), "rel/config.json: no 'cca_num_q_heads'");
  EXPECT_EQ(refused(R"({"zaya_use_eda": false})").find("rel/config.json: 'zaya_use_eda' is false"), 0u);
  EXPECT_EQ(refused(R"({"moe_router_topk": 2})"), "rel/config.json: 'moe_router_topk' is 2: keel's ZAYA1 routes top-1");
  // Each layout's config read as the other's says which --names reads it.
  EXPECT_EQ(error_of(j, Names::kZaya1),
            "rel/config.json: 'cca_num_q_heads' is a key of the alternating-layer layout's config: use --names "
            "zaya1-alternating");
  EXPECT_EQ(error_of(tiny(), Names::kZaya1Alternating),
            "rel/config.json: 'layer_types' is a key of the zaya1 layout's config: use --names zaya1");
}

// config.json's token ids: the tokenizer's as given, the release's only for its vocabulary, else
// null (a byte-tokenizer model's id 106 is the letter 'j', which HF's generate would stop on).
TEST(ReleasedConfig, TokenIds) {
  const ModelConfig tiny_model = config("zaya1-tiny.yaml");
  EXPECT_FALSE(default_token_ids(tiny_model).eos.has_value());
  const TokenIds release = default_token_ids(config("zaya1-8b.yaml"));
  EXPECT_EQ(*release.pad, 0);
  EXPECT_EQ(*release.bos, 2);
  EXPECT_EQ(*release.eos, 106);
  json j = hf_config(tiny_model, Names::kZaya1, "float32", {});
  EXPECT_TRUE(j["eos_token_id"].is_null() && j["bos_token_id"].is_null() && j["pad_token_id"].is_null());
  j = hf_config(tiny_model, Names::kZaya1, "float32", parse_token_ids("256,257,258", tiny_model.vocab_size));
  EXPECT_EQ(j["pad_token_id"], 256);
  EXPECT_EQ(j["bos_token_id"], 257);
  EXPECT_EQ(j["eos_token_id"], 258);
  const TokenIds some = parse_token_ids("none,none,7", tiny_model.vocab_size);
  EXPECT_FALSE(some.pad.has_value());
  EXPECT_EQ(*some.eos, 7);
  // The importer reads either form back (token ids do not shape the computation).
  EXPECT_EQ(model_of_hf_config(j, Names::kZaya1, tiny_model.name, "config.json"), tiny_model);
  for (const char* bad : {"1,2", "1,2,x", "1,2,-3", "1,2,99999", "1,,3"})
    EXPECT_NE(test::error_message<UsageError>([&] { parse_token_ids(bad, tiny_model.vocab_size); }).find("--token-ids"),
              std::string::npos)
        << bad;
}

}  // namespace
}  // namespace keel::model::released
