// stream_inference on the host backend: the generator's files read back, the streamed output
// equals the plain-read reference bit for bit with the device budget a fraction of the model, and
// every bad model, input or budget is a clear error.
#include "model.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "io/io_test_util.h"
#include "strata/base/error.h"
#include "strata/runtime/safetensors.h"

namespace strata::testing {
namespace {

using examples::assess_roofline;
using examples::describe_model;
using examples::generate_model;
using examples::InferenceConfig;
using examples::run_reference;
using examples::run_streamed;
namespace st = strata::safetensors;

class StreamInferenceTest : public ::testing::Test {
 protected:
  std::vector<float> input(std::size_t n) const {
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i)
      x[i] = static_cast<float>(static_cast<int>(i * 37 % 19) - 9) / 9.0f;
    return x;
  }
  // A model of the given tensors, every byte 0x3c (a small positive bf16 / f16 / f32 value).
  std::string write_model(const std::string& name, const std::vector<st::TensorSpec>& specs) {
    const std::string path = dir_.file(name);
    st::Writer w(path, specs);
    for (const st::TensorSpec& s : specs) {
      std::size_t bytes = dtype_bytes(s.dtype);
      for (std::int64_t d : s.shape)
        bytes *= static_cast<std::size_t>(d);
      std::vector<unsigned char> fill(bytes, 0x3c);
      w.write(fill.data(), fill.size());
    }
    w.finish();
    return path;
  }
  std::string error_of(const InferenceConfig& c) {
    try {
      run_streamed(c);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  }
  TempDir dir_;
};

TEST_F(StreamInferenceTest, TheGeneratorWritesAModelTheReaderAccepts) {
  const std::string path = dir_.file("g.safetensors");
  const std::uint64_t bytes = generate_model(path, 5, 200, DType::BF16, 7);
  const st::Header h = st::read_header(path);
  EXPECT_EQ(h.file_bytes, bytes);
  EXPECT_EQ(h.tensors.size(), 10u);
  EXPECT_EQ(h.metadata.at("seed"), "7");
  const auto m = describe_model(h, path);
  ASSERT_EQ(m.layers.size(), 5u);
  EXPECT_EQ(m.input_dim(), 200);
  EXPECT_EQ(m.output_dim(), 200);
  EXPECT_EQ(m.model_bytes, 5u * (200 * 200 + 200) * 2);
  EXPECT_EQ(h.at("layers.4.bias").shape, (std::vector<std::int64_t>{200}));
  EXPECT_EQ(h.at("layers.2.weight").dtype, DType::BF16);
  // The same seed writes the same bytes; another seed does not.
  const std::string again = dir_.file("g2.safetensors"), other = dir_.file("g3.safetensors");
  generate_model(again, 5, 200, DType::BF16, 7);
  generate_model(other, 5, 200, DType::BF16, 8);
  EXPECT_EQ(read_file(path), read_file(again));
  EXPECT_NE(read_file(path), read_file(other));
}

TEST_F(StreamInferenceTest, StreamedOutputEqualsTheReferenceWithAFractionOfTheModelOnTheDevice) {
  for (DType dtype : {DType::BF16, DType::F16, DType::F32}) {
    const std::string path = dir_.file(std::string(to_string(dtype)) + ".safetensors");
    generate_model(path, 24, 128, dtype);
    InferenceConfig c;
    c.model = path;
    c.batch = 3;
    c.input = input(3 * 128);
    c.device_budget = 256 * 1024;  // the buffers and about two layers
    c.host_budget = 20 * 1024 * 1024;
    c.passes = 2;
    c.min_seconds = 0;  // exactly two passes
    c.measure = false;
    const auto r = run_streamed(c);
    EXPECT_GE(r.model.model_bytes, 3 * c.device_budget) << to_string(dtype);
    EXPECT_TRUE(r.passes_agree);
    EXPECT_GE(r.bytes_nvme_read, 2 * r.model.model_bytes);  // each pass read the file again
    EXPECT_LE(r.peak_device_bytes, c.device_budget);
    const auto expected = run_reference(path, c.input, c.batch);
    ASSERT_EQ(r.output.size(), 3u * 128);
    EXPECT_EQ(r.output, expected) << to_string(dtype);  // bit for bit
    bool nonzero = false;
    for (float v : expected)
      nonzero = nonzero || v != 0.0f;
    EXPECT_TRUE(nonzero) << "a forward pass of zeros proves nothing";
    for (const char* prefetch : {"none", "2"}) {
      c.prefetch = prefetch;
      c.passes = 1;
      EXPECT_EQ(run_streamed(c).output, expected) << prefetch;
    }
  }
}

// The measuring passes (compute-only, transfer-only) run beside the timed ones without changing
// what the timed ones do: the compute-only pass computes the same output from each layer's own
// weights, and only the timed passes' reads are counted. No timing is asserted: the roofline
// guard is lifted, and its own test below uses fixed figures.
TEST_F(StreamInferenceTest, MeasuringPassesComputeTheSameOutputAndCountNoReads) {
  const std::string path = dir_.file("m.safetensors");
  generate_model(path, 10, 96, DType::BF16);
  InferenceConfig c;
  c.model = path;
  c.batch = 4;
  c.input = input(4 * 96);
  c.device_budget = 160 * 1024;  // the buffers and one or two layers
  c.prefetch = "none";           // each layer read once per pass: the byte counts are exact
  c.passes = 3;
  c.min_seconds = 0;  // exactly three passes each: the byte counts compare
  c.measure = false;
  const auto plain = run_streamed(c);
  c.measure = true;
  c.max_roofline = std::numeric_limits<double>::infinity();
  const auto measured = run_streamed(c);
  EXPECT_TRUE(measured.passes_agree);  // the compute-only passes gave the timed passes' output
  EXPECT_EQ(measured.output, run_reference(path, c.input, c.batch));
  EXPECT_EQ(measured.output, plain.output);
  EXPECT_EQ(measured.bytes_nvme_read, plain.bytes_nvme_read);
  EXPECT_GE(plain.bytes_nvme_read, 3 * plain.model.model_bytes);
  EXPECT_GT(measured.compute_s, 0.0);
  EXPECT_GT(measured.transfer_s, 0.0);
  EXPECT_GT(measured.step_s, 0.0);
  EXPECT_DOUBLE_EQ(measured.roofline,
                   std::max(measured.compute_s, measured.transfer_s) / measured.step_s);
  EXPECT_EQ(plain.compute_s, 0.0);  // not measured: not reported
  EXPECT_EQ(plain.roofline, 0.0);
}

TEST_F(StreamInferenceTest, ARooflineAboveTheLimitIsUntrustedAndNamesTheThreeFigures) {
  EXPECT_DOUBLE_EQ(assess_roofline(0.9, 0.5, 1.0).value, 0.9);
  EXPECT_TRUE(assess_roofline(0.9, 0.5, 1.0).trusted);
  EXPECT_TRUE(assess_roofline(0.5, 1.02, 1.0).trusted);  // at the limit: accepted
  EXPECT_EQ(assess_roofline(0.5, 1.02, 1.0).warning, "");
  EXPECT_EQ(assess_roofline(0.5, 0.5, 0.0).value, 0.0);
  const strata::Roofline r = assess_roofline(0.25, 1.32, 1.0);
  EXPECT_FALSE(r.trusted);
  EXPECT_DOUBLE_EQ(r.value, 1.32);
  EXPECT_NE(r.warning.find("roofline 1.320 = max(compute_s 0.250000 s, transfer_s 1.320000 s) / "
                           "step_s 1.000000 s is above 1.02"),
            std::string::npos)
      << r.warning;
  EXPECT_FALSE(assess_roofline(1.0, 0.0, 0.5, 1.5).trusted);
  EXPECT_FALSE(assess_roofline(0.1, 0.1, 1.0, 0.0).trusted);
}

// Note [Measuring until the figures hold]: the passes go on until every measured figure's passes
// add up to min_seconds, from at least `passes` of them; the count follows the wall time, so what
// is asserted is the rule itself (no timing is expected of the machine).
TEST_F(StreamInferenceTest, PassesGoOnUntilEachFigureHasRunItsMinimumTime) {
  const std::string path = dir_.file("small.safetensors");
  generate_model(path, 4, 64, DType::F32);
  InferenceConfig c;
  c.model = path;
  c.batch = 2;
  c.input = input(2 * 64);
  c.passes = 2;
  c.min_seconds = 0.05;
  c.max_roofline = std::numeric_limits<double>::infinity();
  const auto r = run_streamed(c);
  ASSERT_EQ(r.step_runs_s.size(), static_cast<std::size_t>(r.passes_run));
  EXPECT_GE(r.passes_run, 2);
  double sum = 0;
  for (double t : r.step_runs_s)
    sum += t;
  EXPECT_GE(sum, 0.05);
  EXPECT_TRUE(r.figures_trusted);  // an infinite limit trusts any figure
  EXPECT_EQ(r.warning, "");
  EXPECT_EQ(r.output, run_reference(path, c.input, c.batch));
  c.min_seconds = 0;
  EXPECT_EQ(run_streamed(c).passes_run, 2);  // no time asked: exactly --passes
}

TEST_F(StreamInferenceTest, BadModelsInputsAndBudgetsAreClearErrors) {
  using S = st::TensorSpec;
  const auto w = [](int i, std::int64_t out, std::int64_t in, DType d = DType::F32) {
    return S{"layers." + std::to_string(i) + ".weight", d, {out, in}};
  };
  const auto b = [](int i, std::int64_t out, DType d = DType::F32) {
    return S{"layers." + std::to_string(i) + ".bias", d, {out}};
  };
  struct Case {
    const char* name;
    std::vector<S> specs;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"empty", {{"other", DType::F32, {2}}}, "no layers.0.weight: not a streamable MLP"},
      {"missing layer", {w(0, 8, 8), b(0, 8), w(2, 8, 8), b(2, 8)}, "layers.1.weight is missing"},
      {"missing bias", {w(0, 8, 8), b(0, 8), w(1, 8, 8)}, "layers.1.bias is missing"},
      {"mismatched layers",
       {w(0, 16, 8), b(0, 16), w(1, 8, 12), b(1, 8)},
       "layers.1.weight takes 12 inputs but layers.0 gives 16 outputs"},
      {"bias shape", {w(0, 8, 8), b(0, 7)}, "layers.0.bias must have shape [8]"},
      {"weight rank",
       {{"layers.0.weight", DType::F32, {64}}, b(0, 8)},
       "must have shape [out, in]"},
      {"dtype", {w(0, 8, 8, DType::I8), b(0, 8)}, "layers.0.weight is i8: only F32, F16 and BF16"},
  };
  for (const Case& k : cases) {
    InferenceConfig c;
    c.model = write_model(std::string(k.name) + ".safetensors", k.specs);
    c.input = input(8);
    c.measure = false;
    const std::string m = error_of(c);
    EXPECT_NE(m.find(k.expect), std::string::npos) << k.name << ": " << m;
    EXPECT_NE(m.find(c.model), std::string::npos) << k.name << ": " << m;
  }
  // A malformed file (here: a hole in the data section) is the reader's error.
  {
    const std::string path = dir_.file("holey.safetensors");
    const std::string header =
        R"({"layers.0.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}})";
    std::string img(8, '\0');
    img[0] = static_cast<char>(header.size());
    img += header + std::string(8, '\0');
    write_bytes(path, img);
    InferenceConfig c;
    c.model = path;
    c.input = input(1);
    EXPECT_NE(error_of(c).find("leave a hole of 4 bytes"), std::string::npos) << error_of(c);
  }
  const std::string good = dir_.file("good.safetensors");
  generate_model(good, 4, 64, DType::BF16);
  InferenceConfig c;
  c.model = good;
  c.batch = 2;
  c.input = input(3 * 64);  // three rows for a batch of two
  c.measure = false;
  EXPECT_NE(error_of(c).find("the input has 192 values; the model takes batch 2 x 64 = 128"),
            std::string::npos)
      << error_of(c);
  c.input = input(2 * 64);
  c.device_budget = 64 * 1024;
  const std::string m = error_of(c);
  EXPECT_NE(
      m.find("device budget 64.00 KiB is smaller than the largest layer (layers.0: 8.12 KiB)"),
      std::string::npos)
      << m;
  c.device_budget = 0;
  c.prefetch = "soon";
  EXPECT_NE(error_of(c).find("--prefetch: \"soon\""), std::string::npos) << error_of(c);
}

}  // namespace
}  // namespace strata::testing
