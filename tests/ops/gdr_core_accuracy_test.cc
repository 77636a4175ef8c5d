// The GDR core accuracy harness of issue 31 (bench/gdr_core_accuracy.h) on CPU at a small
// shape with Hv = 2 Hk: its two FP64 references (chunked composite and token-by-token
// recurrence) agree to FP64 rounding, the FP32 CPU core lands within FP32 error of them,
// the error figures mean what the tables say, and the inputs file holds the inputs and
// the reference bit for bit (what tools/gpu/gdn_anchor_accuracy.py reads).
#include "bench/gdr_core_accuracy.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "io/safetensors.h"

namespace gdr::bench {
namespace {

// Two chunks and a ragged tail (T = 130 with C = 64), two value heads per key head.
AccuracyShape small_shape() { return {.B = 2, .T = 130, .H = 4, .Hk = 2, .dk = 16, .dv = 8}; }

TEST(GdrCoreAccuracyTest, InputsAreSeededAndShaped) {
  const AccuracyShape s = small_shape();
  const AccuracyInputs a = make_accuracy_inputs(s, 7), b = make_accuracy_inputs(s, 7);
  EXPECT_TRUE(at::equal(a.q, b.q) && at::equal(a.g, b.g) && at::equal(a.d_o, b.d_o));
  EXPECT_FALSE(at::equal(a.q, make_accuracy_inputs(s, 8).q));
  EXPECT_EQ(a.q.sizes(), (at::IntArrayRef{2, 130, 2, 16}));
  EXPECT_EQ(a.v.sizes(), (at::IntArrayRef{2, 130, 4, 8}));
  EXPECT_EQ(a.q.scalar_type(), at::kBFloat16);
  EXPECT_EQ(a.beta.scalar_type(), at::kBFloat16);
  EXPECT_EQ(a.g.scalar_type(), at::kFloat);
  EXPECT_TRUE(a.g.lt(0).all().item<bool>());
  EXPECT_DOUBLE_EQ(a.scale, 0.25);
}

TEST(GdrCoreAccuracyTest, ReferencesAgreeAndFp32IsClose) {
  const AccuracyShape s = small_shape();
  const AccuracyInputs in = make_accuracy_inputs(s, 0);
  const at::Device cpu(at::kCPU);
  const NamedResults chunked = run_gdr_core(in, at::kDouble, cpu, CoreForm::kChunked);
  const NamedResults recurrent = run_gdr_core(in, at::kDouble, cpu, CoreForm::kRecurrent);
  const NamedResults fp32 = run_gdr_core(in, at::kFloat, cpu);
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta"};
  ASSERT_EQ(chunked.size(), 7u);
  for (size_t i = 0; i < chunked.size(); ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(chunked[i].first, names[i]);
    EXPECT_EQ(chunked[i].second.scalar_type(), at::kDouble);
    EXPECT_EQ(chunked[i].second.sizes(), recurrent[i].second.sizes());
    EXPECT_LT(error_of(recurrent[i].second, chunked[i].second).max_rel_err, 1e-11);
    const ErrorFigures e = error_of(fp32[i].second, chunked[i].second);
    EXPECT_GT(e.max_abs_ref, 0);
    EXPECT_LT(e.max_rel_err, 1e-4);
  }
  // dq and dk are the raw (pre-norm) inputs' gradients, in their shape.
  EXPECT_EQ(fp32[2].second.sizes(), in.q.sizes());
  EXPECT_EQ(fp32[3].second.sizes(), in.k.sizes());
}

TEST(GdrCoreAccuracyTest, ErrorFigures) {
  const at::Tensor ref = at::tensor({1.0, -4.0, 2.0}, at::kDouble);
  const at::Tensor x = at::tensor({1.0f, -3.0f, 2.0f});
  const ErrorFigures e = error_of(x, ref);
  EXPECT_DOUBLE_EQ(e.max_abs_err, 1.0);
  EXPECT_DOUBLE_EQ(e.max_abs_ref, 4.0);
  EXPECT_DOUBLE_EQ(e.max_rel_err, 0.25);
  EXPECT_NEAR(e.rel_l2_err, 1.0 / std::sqrt(21.0), 1e-15);
  const std::string line = accuracy_line("gdr", "bf16", "o", small_shape(), e);
  EXPECT_EQ(line.rfind("ACCURACY {\"impl\":\"gdr\",\"path\":\"bf16\",\"tensor\":\"o\",", 0), 0u)
      << line;
}

TEST(GdrCoreAccuracyTest, FileHoldsInputsAndReference) {
  const AccuracyShape s = small_shape();
  const AccuracyInputs in = make_accuracy_inputs(s, 3);
  const NamedResults ref = run_gdr_core(in, at::kDouble, at::Device(at::kCPU));
  const std::string path = testing::TempDir() + "/gdr_core_accuracy_inputs.safetensors";
  ASSERT_TRUE(write_accuracy_file(path, in, s, 3, ref, "test").ok());
  const auto contents = io::read_safetensors(path);
  ASSERT_TRUE(contents.ok()) << contents.status();
  const std::pair<const char*, const at::Tensor*> expected[] = {{"q", &in.q},
                                                                {"k", &in.k},
                                                                {"v", &in.v},
                                                                {"g", &in.g},
                                                                {"beta", &in.beta},
                                                                {"d_o", &in.d_o},
                                                                {"ref_o", &ref[0].second},
                                                                {"ref_dbeta", &ref[6].second}};
  for (const auto& [name, tensor] : expected) {
    SCOPED_TRACE(name);
    const at::Tensor* t = contents->find(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->scalar_type(), tensor->scalar_type());
    EXPECT_TRUE(at::equal(*t, *tensor));
  }
  EXPECT_EQ(contents->metadata.at("seed"), "3");
  EXPECT_EQ(contents->metadata.at("scale"), "0.25");
  EXPECT_EQ(contents->metadata.at("shape"),
            "{\"B\":2,\"H\":4,\"Hk\":2,\"T\":130,\"dk\":16,\"dv\":8}");
}

}  // namespace
}  // namespace gdr::bench
