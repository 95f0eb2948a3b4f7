// safetensors: round trips through the streaming writer, every malformed case named, and a file's
// tensors mapped into the runtime and read back through the O_DIRECT path at unaligned offsets.
#include "strata/runtime/safetensors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/runtime_fixture.h"
#include "strata/base/error.h"

namespace strata::testing {
namespace {

namespace st = strata::safetensors;

// A file image: the 8-byte little-endian length, the header, then `data_bytes` bytes.
std::string image(const std::string& header, std::size_t data_bytes) {
  std::string out(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data_bytes, '\x5a');
  return out;
}

// The error message of parsing `img`, or "(parsed)".
std::string error_of(const std::string& img) {
  try {
    st::parse_image(img, "m.safetensors");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::corrupt_data) << e.what();
    return e.what();
  }
  return "(parsed)";
}

TEST(Safetensors, ParsesAValidHeader) {
  const std::string h =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[3],"data_offsets":[4,10]},)"
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("z":{"dtype":"U8","shape":[0,5],"data_offsets":[10,10]}})";
  const st::Header hd = st::parse_image(image(h, 10));
  ASSERT_EQ(hd.tensors.size(), 3u);
  EXPECT_EQ(hd.tensors[0].name, "a");  // in data order
  EXPECT_EQ(hd.tensors[1].name, "b");
  EXPECT_EQ(hd.at("b").dtype, DType::BF16);
  EXPECT_EQ(hd.at("b").shape, (std::vector<std::int64_t>{3}));
  EXPECT_EQ(hd.at("b").offset, 8 + h.size() + 4);
  EXPECT_EQ(hd.at("b").bytes(), 6u);
  EXPECT_EQ(hd.metadata.at("format"), "pt");
  EXPECT_EQ(hd.find("nope"), nullptr);
  EXPECT_THROW((void)hd.at("nope"), Error);
}

struct Malformed {
  const char* what;
  std::string file;
  const char* expect;  // a part of the message
};

TEST(Safetensors, EveryMalformedCaseIsAnErrorNamingTheProblem) {
  const auto t = [](const std::string& entry) { return R"({"w":)" + entry + "}"; };
  const std::vector<Malformed> cases = {
      {"short file", std::string(5, '\0'), "too short for a safetensors file"},
      {"length past the end", image("{}", 0).substr(0, 9), "runs past the end of the file"},
      {"huge length", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",
       "exceeds the 100000000-byte limit"},
      {"not json", image("{\"w\": [1,", 0), "the header is not valid JSON"},
      {"not an object", image("[1, 2]", 0), "the header is not a JSON object"},
      {"duplicate tensor",
       image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
             R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
             2),
       "tensor \"w\" appears twice"},
      {"entry not an object", image(t("3"), 0), "tensor \"w\": its entry is not an object"},
      {"no dtype", image(t(R"({"shape":[1],"data_offsets":[0,1]})"), 1), "tensor \"w\": no dtype"},
      {"unknown dtype", image(t(R"({"dtype":"F12","shape":[1],"data_offsets":[0,1]})"), 1),
       "tensor \"w\": unknown dtype \"F12\""},
      {"unsupported dtype", image(t(R"({"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]})"), 1),
       "dtype F8_E4M3 is not supported"},
      {"negative dim", image(t(R"({"dtype":"U8","shape":[-1],"data_offsets":[0,1]})"), 1),
       "not a non-negative integer"},
      {"float dim", image(t(R"({"dtype":"U8","shape":[1.5],"data_offsets":[0,1]})"), 1),
       "not a non-negative integer"},
      {"shape not an array", image(t(R"({"dtype":"U8","shape":4,"data_offsets":[0,4]})"), 4),
       "shape is not an array"},
      {"nested too deep", image(t(R"({"dtype":"U8","shape":[[1]],"data_offsets":[0,1]})"), 1),
       "nests deeper"},
      {"overflowing shape",
       image(t(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})"), 4),
       "more bytes than 2^64"},
      {"offsets of three", image(t(R"({"dtype":"U8","shape":[1],"data_offsets":[0,1,2]})"), 1),
       "is not [begin, end]"},
      {"end before begin", image(t(R"({"dtype":"U8","shape":[0],"data_offsets":[2,1]})"), 2),
       "end before they begin"},
      {"past the data", image(t(R"({"dtype":"U8","shape":[8],"data_offsets":[0,8]})"), 4),
       "run past the end of the data section (4 bytes)"},
      {"size mismatch", image(t(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), 4),
       "hold 4 bytes but dtype F32 and shape [2] need 8"},
      {"overlap",
       image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
             6),
       "tensor \"b\": data_offsets [2, 6] overlap tensor \"a\""},
      {"hole",
       image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
             R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
             6),
       "tensor \"b\": data_offsets [4, 6] leave a hole of 2 bytes"},
      {"trailing bytes", image(t(R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})"), 5),
       "the data section has 5 bytes but the tensors cover 2"},
      {"metadata not strings", image(R"({"__metadata__":{"k":1}})", 0),
       "__metadata__ \"k\" is not a string"},
      {"unknown key", image(t(R"({"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1})"), 1),
       "unknown key \"x\""},
  };
  for (const Malformed& c : cases) {
    const std::string m = error_of(c.file);
    EXPECT_NE(m.find(c.expect), std::string::npos) << c.what << ": " << m;
    EXPECT_EQ(m.rfind("m.safetensors: ", 0), 0u) << c.what << ": " << m;
  }
}

class SafetensorsFileTest : public ::testing::Test {
 protected:
  TempDir dir_;
};

TEST_F(SafetensorsFileTest, TheWriterRoundTripsAndTheRuntimeReadsUnalignedTensors) {
  const std::string path = dir_.file("model.safetensors");
  // Odd sizes put every tensor after the first at an offset that is not 4 KiB aligned (nor 4).
  const std::vector<st::TensorSpec> specs = {{"tiny", DType::U8, {3}},
                                             {"w", DType::F32, {130, 257}},
                                             {"b", DType::BF16, {4097}},
                                             {"empty", DType::F16, {0}},
                                             {"last", DType::I64, {5}}};
  std::vector<std::vector<unsigned char>> data;
  {
    st::Writer w(path, specs, {{"source", "test"}});
    for (std::size_t i = 0; i < specs.size(); ++i) {
      std::size_t bytes = dtype_bytes(specs[i].dtype);
      for (std::int64_t d : specs[i].shape)
        bytes *= static_cast<std::size_t>(d);
      data.push_back(pattern(bytes, static_cast<unsigned>(i + 1)));
      // In pieces, as a generator that never holds a whole tensor would.
      const std::size_t half = bytes / 2;
      w.write(data.back().data(), half);
      w.write(data.back().data() + half, bytes - half);
    }
    w.finish();
  }
  const st::Header h = st::read_header(path);
  EXPECT_EQ(h.data_offset % 8, 0u);  // the writer pads the header
  EXPECT_EQ(h.metadata.at("source"), "test");
  ASSERT_EQ(h.tensors.size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const st::TensorInfo& t = h.at(specs[i].name);
    EXPECT_EQ(t.dtype, specs[i].dtype);
    EXPECT_EQ(t.shape, specs[i].shape);
    EXPECT_EQ(t.bytes(), data[i].size());
  }
  EXPECT_NE(h.at("w").offset % 4096, 0u);
  EXPECT_NE(h.at("b").offset % 4, 0u);

  auto rt = std::make_unique<Runtime>(small_options(dir_.path()));
  const auto ids = st::map_file(*rt, path, h);
  EXPECT_EQ(ids.count("empty"), 0u);  // nothing to map
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (data[i].empty()) continue;
    const TensorId id = ids.at(specs[i].name);
    EXPECT_EQ(rt->describe(id).dtype, specs[i].dtype);
    Lease lease = rt->acquire(id, Tier::Device, Access::Read).get();
    EXPECT_EQ(leased_bytes(lease), data[i]) << specs[i].name;
  }
  EXPECT_GT(rt->io()->stats().bytes_read, 0u);  // through the io engine, not a page-cache copy
}

TEST_F(SafetensorsFileTest, PageAlignedDataIsReadInPlaceAndUnalignedDataThroughABounce) {
  // Two files with the same tensors, whose sizes are page multiples: the library's 8-byte
  // alignment puts them off the file's pages, 4 KiB alignment on them.
  const std::vector<st::TensorSpec> specs = {{"w", DType::F32, {64, 1024}},
                                             {"b", DType::BF16, {2048}}};
  std::vector<std::vector<unsigned char>> data = {pattern(64 * 1024 * 4, 7), pattern(4096, 8)};
  std::uint64_t bounced[2] = {0, 0}, tail = 0;
  for (const std::uint64_t alignment : {std::uint64_t{8}, std::uint64_t{4096}}) {
    const std::string path = dir_.file("a" + std::to_string(alignment) + ".safetensors");
    {
      st::Writer w(path, specs, {}, alignment);
      for (const auto& d : data)
        w.write(d.data(), d.size());
      w.finish();
    }
    const st::Header h = st::read_header(path);
    EXPECT_EQ(h.data_offset % alignment, 0u);
    EXPECT_EQ(h.at("w").offset % 4096 == 0, alignment == 4096);
    if (alignment == 8) tail = std::filesystem::file_size(path) % 4096;
    auto rt = std::make_unique<Runtime>(small_options(dir_.path()));
    const auto ids = st::map_file(*rt, path, h);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      Lease lease = rt->acquire(ids.at(specs[i].name), Tier::Device, Access::Read).get();
      EXPECT_EQ(leased_bytes(lease), data[i]) << specs[i].name << ", alignment " << alignment;
    }
    bounced[alignment == 4096] = rt->swap()->bounced_bytes();
    EXPECT_EQ(nlohmann::json::parse(rt->stats_json())["io"]["bytes_bounced"],
              bounced[alignment == 4096]);
  }
  // Unaligned: every byte copied once, but the file's last partial page (read buffered, into
  // place). Aligned: none.
  ASSERT_GT(tail, 0u);
  EXPECT_EQ(bounced[0], data[0].size() + data[1].size() - tail);
  EXPECT_EQ(bounced[1], 0u);  // none
  EXPECT_THROW(st::Writer(dir_.file("x.safetensors"), specs, {}, 12), Error);
}

TEST_F(SafetensorsFileTest, ReadHeaderNamesTheFile) {
  const std::string path = dir_.file("bad.safetensors");
  std::ofstream(path, std::ios::binary) << image(R"({"w":{"dtype":"F32"}})", 0);
  try {
    st::read_header(path);
    FAIL() << "parsed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": tensor \"w\": no shape"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(st::read_header(dir_.file("missing.safetensors")), IoError);
  EXPECT_THROW(st::Writer(dir_.path() + "/no/such/dir/x.safetensors", {}), IoError);
}

TEST_F(SafetensorsFileTest, TheWriterRefusesTooManyOrTooFewBytes) {
  const std::string path = dir_.file("w.safetensors");
  st::Writer w(path, {{"a", DType::F32, {2}}});
  const float v[3] = {1, 2, 3};
  EXPECT_THROW(w.write(v, sizeof v), Error);
  st::Writer w2(path, {{"a", DType::F32, {2}}});
  w2.write(v, 4);
  EXPECT_THROW(w2.finish(), Error);
}

}  // namespace
}  // namespace strata::testing
