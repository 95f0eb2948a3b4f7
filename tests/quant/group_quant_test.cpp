// Group-wise int8/int4 quantization (strata/quant/group_quant.h): the layout's sizes, the error
// bound of every element (half its group's step, plus the roundings of dequantization) for both
// widths, three source dtypes and odd shapes, every dequantizer variant giving the same bits,
// row ranges, and the errors for input that cannot be compressed. The exact reference (numpy,
// written independently) is tests/python/test_quant.py.
#include "strata/quant/group_quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/base/error.h"
#include "strata/base/half.h"

namespace strata::quant {
namespace {

TEST(GroupQuant, LayoutCountsGroupsCodesAndPadding) {
  Layout a = layout({Bits::Int8, 64}, 3, 100);  // groups of 64 and 36
  EXPECT_EQ(a.groups_per_row, 2u);
  EXPECT_EQ(a.row_code_bytes, 100u);
  EXPECT_EQ(a.row_stride, 108u);  // 8 bytes of min/scale, 100 of codes
  EXPECT_EQ(a.bytes, 324u);
  Layout b = layout({Bits::Int4, 64}, 2, 129);  // 3 groups, 65 bytes of codes, padded to 80
  EXPECT_EQ(b.groups_per_row, 3u);
  EXPECT_EQ(b.row_code_bytes, 65u);
  EXPECT_EQ(b.row_stride, 80u);
  const std::int64_t shape[] = {2, 3, 4096};
  Layout c = layout({Bits::Int4, 64}, shape);
  EXPECT_EQ(c.rows, 6u);
  EXPECT_EQ(c.cols, 4096u);
  // An fp32 weight in int8 is 0.266 of its bytes, in int4 0.141 (the 0.3 and 0.17).
  EXPECT_EQ(layout({Bits::Int8, 64}, 1, 4096).row_stride, 4096u + 256u);
  EXPECT_EQ(layout({Bits::Int4, 64}, 1, 4096).row_stride, 2048u + 256u);
  const std::int64_t scalar[] = {1};
  EXPECT_EQ(layout({Bits::Int8, 64}, std::span<const std::int64_t>(scalar, 0)).rows, 1u);
}

TEST(GroupQuant, RefusesGroupsThatCannotWork) {
  try {
    (void)layout({Bits::Int4, 63}, 1, 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("even group size"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)layout({Bits::Int8, 0}, 1, 10), Error);
  EXPECT_THROW((void)parse_bits("int3"), Error);
  EXPECT_EQ(parse_bits("int4"), Bits::Int4);
}

// Source values of one dtype, as floats (what the tensor holds) and as its bytes.
struct Source {
  std::vector<float> values;
  std::vector<std::uint8_t> bytes;
};

Source make_source(DType dtype, std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Source s;
  s.values.resize(n);
  s.bytes.resize(n * dtype_bytes(dtype));
  for (std::size_t i = 0; i < n; ++i) {
    // Rows of different scales and offsets, as weights are: some tiny, some large, one constant.
    const std::size_t band = (i / 37) % 5;
    float x = band == 0   ? normal(rng) * 1e-3f
              : band == 1 ? normal(rng) * 30.0f + 100.0f
              : band == 2 ? 0.25f
                          : normal(rng);
    if (dtype == DType::BF16) {
      const std::uint16_t h = float_to_bf16(x);
      std::memcpy(s.bytes.data() + 2 * i, &h, 2);
      x = bf16_to_float(h);
    } else if (dtype == DType::F16) {
      const std::uint16_t h = float_to_f16(x);
      std::memcpy(s.bytes.data() + 2 * i, &h, 2);
      x = f16_to_float(h);
    } else {
      std::memcpy(s.bytes.data() + 4 * i, &x, 4);
    }
    s.values[i] = x;
  }
  return s;
}

float output(DType dtype, const std::vector<std::uint8_t>& out, std::size_t i) {
  if (dtype == DType::F32) {
    float f;
    std::memcpy(&f, out.data() + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, out.data() + 2 * i, 2);
  return dtype == DType::BF16 ? bf16_to_float(h) : f16_to_float(h);
}

// Half an ulp of `dtype` at x: the output's own rounding.
double half_ulp(DType dtype, double x) {
  const int mantissa = dtype == DType::F32 ? 23 : dtype == DType::BF16 ? 7 : 10;
  const int min_exp = dtype == DType::F16 ? -14 : -126;
  const int e = x == 0.0 ? min_exp : std::max(min_exp, std::ilogb(x));
  return std::ldexp(1.0, e - mantissa - 1);
}

struct Case {
  Bits bits;
  DType dtype;
  std::uint64_t rows, cols;
  std::uint32_t group;
};

class EveryCase : public ::testing::TestWithParam<Case> {};

TEST_P(EveryCase, EveryElementIsWithinHalfItsGroupsStepAndEveryVariantAgrees) {
  const Case c = GetParam();
  const Scheme scheme{c.bits, c.group};
  const Layout l = layout(scheme, c.rows, c.cols);
  const Source src = make_source(c.dtype, c.rows * c.cols, 7u + c.cols);
  std::vector<std::uint8_t> packed(l.bytes);
  quantize(scheme, l, c.dtype, src.bytes.data(), packed.data(), "w");
  const double levels = c.bits == Bits::Int8 ? 255 : 15;
  std::vector<std::vector<std::uint8_t>> outs;
  for (Isa isa : {Isa::baseline, Isa::avx2, Isa::avx512f}) {
    if (!supports(isa)) continue;
    std::vector<std::uint8_t> out(c.rows * c.cols * dtype_bytes(c.dtype), 0xAB);
    dequantize(c.bits, l, packed.data(), c.dtype, out.data(), 0, l.rows, isa);
    outs.push_back(std::move(out));
  }
  ASSERT_FALSE(outs.empty());
  for (std::size_t k = 1; k < outs.size(); ++k)
    ASSERT_EQ(outs[k], outs[0]) << "variant " << k << " differs from the baseline";
  const std::vector<std::uint8_t>& out = outs[0];
  for (std::uint64_t r = 0; r < c.rows; ++r) {
    const std::uint8_t* row = packed.data() + r * l.row_stride;
    for (std::uint64_t j = 0; j < c.cols; ++j) {
      const std::uint64_t g = j / c.group;
      std::uint16_t m16, s16;
      std::memcpy(&m16, row + 4 * g, 2);
      std::memcpy(&s16, row + 4 * g + 2, 2);
      const double m = f16_to_float(m16), s = f16_to_float(s16);
      const std::size_t i = r * c.cols + j;
      const double x = src.values[i], y = output(c.dtype, out, i);
      // The group's min and step: m <= every value, and m + L s reaches the largest.
      ASSERT_LE(m, x) << "row " << r << " col " << j;
      ASSERT_GE(m + levels * s, x) << "row " << r << " col " << j;
      // Half a step, plus fp32's two roundings (q s, then + m) and the output's.
      const double bound = s / 2 + 2 * half_ulp(DType::F32, std::abs(y) + std::abs(m)) * 2 +
                           half_ulp(c.dtype, std::abs(y));
      ASSERT_LE(std::abs(y - x), bound)
          << "row " << r << " col " << j << " x " << x << " y " << y << " step " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WidthsDtypesShapes, EveryCase,
    ::testing::Values(
        Case{Bits::Int8, DType::F32, 7, 100, 64}, Case{Bits::Int4, DType::F32, 7, 100, 64},
        Case{Bits::Int8, DType::BF16, 5, 129, 64}, Case{Bits::Int4, DType::BF16, 5, 129, 64},
        Case{Bits::Int8, DType::F16, 3, 301, 32}, Case{Bits::Int4, DType::F16, 3, 301, 32},
        Case{Bits::Int8, DType::F32, 1, 5, 64},      // one short group
        Case{Bits::Int4, DType::F32, 4, 1, 64},      // one element a row
        Case{Bits::Int4, DType::F32, 2, 1000, 256},  // groups longer than a block
        Case{Bits::Int8, DType::F32, 3, 1031, 1031}));

TEST(GroupQuant, RowRangesDequantizeAsTheWhole) {
  const Scheme scheme{Bits::Int4, 64};
  const Layout l = layout(scheme, 9, 77);
  const Source src = make_source(DType::F32, 9 * 77, 3);
  std::vector<std::uint8_t> packed(l.bytes);
  quantize(scheme, l, DType::F32, src.bytes.data(), packed.data(), "w", 0, 4);
  quantize(scheme, l, DType::F32, src.bytes.data(), packed.data(), "w", 4, 9);
  std::vector<std::uint8_t> whole(l.bytes);
  quantize(scheme, l, DType::F32, src.bytes.data(), whole.data(), "w");
  EXPECT_EQ(packed, whole);
  std::vector<float> all(9 * 77), parts(9 * 77);
  dequantize(scheme.bits, l, packed.data(), DType::F32, all.data(), 0, 9);
  dequantize(scheme.bits, l, packed.data(), DType::F32, parts.data(), 0, 3);
  dequantize(scheme.bits, l, packed.data() + 3 * l.row_stride, DType::F32, parts.data() + 3 * 77, 3,
             9);
  EXPECT_EQ(all, parts);
}

TEST(GroupQuant, AConstantGroupComesBackExactly) {
  const Scheme scheme{Bits::Int8, 64};
  const Layout l = layout(scheme, 1, 64);
  std::vector<float> x(64, 0.1f), y(64);
  std::vector<std::uint8_t> packed(l.bytes);
  quantize(scheme, l, DType::F32, x.data(), packed.data(), "w");
  dequantize(scheme.bits, l, packed.data(), DType::F32, y.data(), 0, 1);
  // m is the largest fp16 <= 0.1; the step is the smallest fp16 covering the rest.
  for (float v : y)
    EXPECT_NEAR(v, 0.1f, 1e-7f);
}

TEST(GroupQuant, ErrorsNameTheTensorRowAndGroup) {
  const Scheme scheme{Bits::Int8, 4};
  const Layout l = layout(scheme, 2, 8);
  std::vector<std::uint8_t> packed(l.bytes);
  std::vector<float> x(16, 1.0f);
  x[13] = std::nanf("");
  try {
    quantize(scheme, l, DType::F32, x.data(), packed.data(), "model.layers.0.w");
    FAIL();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(what.find("tensor 'model.layers.0.w': element 5 of row 1 is nan"), std::string::npos)
        << what;
  }
  x[13] = -1e6f;  // beyond fp16: no fp16 min holds it
  try {
    quantize(scheme, l, DType::F32, x.data(), packed.data(), "w");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1 group 1 spans"), std::string::npos) << e.what();
  }
  std::vector<std::int32_t> ints(16);
  try {
    quantize(scheme, l, DType::I32, ints.data(), packed.data(), "ids");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'ids': i32 cannot be compressed"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace strata::quant
