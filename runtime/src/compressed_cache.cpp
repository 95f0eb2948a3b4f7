// The compressed cache of a safetensors file (strata/runtime/compressed_cache.h): its key, its
// checks, its writing (one pass: the header is written again with the CRC32Cs at the end) and
// its mapping
// into a Runtime as compressed tensors. The format is python/strata/torch/_compress.py's.
#include "strata/runtime/compressed_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <span>

#include <nlohmann/json.hpp>

#include "strata/base/error.h"
#include "strata/io/crc32c.h"
#include "strata/runtime/runtime.h"

namespace strata::safetensors {
namespace {

constexpr int kFormat = 1;
constexpr std::uint64_t kPage = 4096;

const char* public_name(DType d) {
  return d == DType::F32 ? "float32" : d == DType::BF16 ? "bfloat16" : "float16";
}
DType from_public(const std::string& s) {
  if (s == "float32") return DType::F32;
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16") return DType::F16;
  const DType d = parse_dtype(s, "compressed cache dtype");  // "F32", "bf16", ...
  STRATA_EXPECTS(quant::compressible(d), "compressed cache: dtype \"", s, "\"");
  return d;
}

std::string hex32(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// Reads `bytes` at `offset` of the file at `path` (throws naming it).
void read_at(int fd, const std::string& path, std::uint64_t offset, void* dst,
             std::uint64_t bytes) {
  auto* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n <= 0) throw IoError(Errc::io_error, path, offset, bytes, n < 0 ? errno : EIO, "pread");
    p += n;
    offset += static_cast<std::uint64_t>(n);
    bytes -= static_cast<std::uint64_t>(n);
  }
}

struct Fd {
  int fd;
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) throw IoError(Errc::io_error, path, 0, 0, errno, "open");
  }
  ~Fd() { ::close(fd); }
};

nlohmann::json key_of(const std::string& source, const quant::Scheme& scheme) {
  struct stat st {};
  if (::stat(source.c_str(), &st) != 0) throw IoError(Errc::io_error, source, 0, 0, errno, "stat");
  return {{"format", kFormat},
          {"source", std::filesystem::canonical(source).string()},
          {"source_size", static_cast<std::uint64_t>(st.st_size)},
          {"source_mtime_ns", static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 +
                                  static_cast<std::int64_t>(st.st_mtim.tv_nsec)},
          {"compress", std::string(quant::to_string(scheme.bits))},
          {"group", scheme.group}};
}

// Why the cache at `path` cannot be used, or "" when it can.
std::string why_stale(const std::string& path, const nlohmann::json& key,
                      const std::vector<std::string>& names, bool verify) {
  if (!std::filesystem::is_regular_file(path)) return "no cache yet";
  try {
    const Header h = read_header(path);
    const auto meta = nlohmann::json::parse(h.metadata.at("strata"));
    for (const auto& [k, v] : key.items())
      if (!meta.contains(k) || meta[k] != v) return k + " changed";
    std::vector<std::string> have;
    for (const auto& [n, info] : meta.at("tensors").items()) {
      have.push_back(n);
      (void)from_public(info.at("dtype").get<std::string>());  // readable, or stale
    }
    std::vector<std::string> want = names;
    std::sort(have.begin(), have.end());
    std::sort(want.begin(), want.end());
    if (have != want) return "another selection of tensors";
    if (verify) {
      Fd f(path);
      std::vector<char> blob;
      for (const auto& [n, info] : meta.at("tensors").items()) {
        const std::uint64_t bytes = info.at("stored_bytes");
        blob.resize(bytes);
        read_at(f.fd, path, h.at(n).offset, blob.data(), bytes);
        if (hex32(crc32c(blob.data(), bytes)) != info.at("crc32c").get<std::string>())
          return "tensor '" + n + "' fails its CRC32C (a corrupt cache)";
      }
    }
  } catch (const std::exception& e) {
    return std::string("unreadable (") + e.what() + ")";
  }
  return "";
}

}  // namespace

std::string compressed_cache_path(const std::string& source, const std::string& cache_dir,
                                  const quant::Scheme& scheme) {
  const std::string abs = std::filesystem::canonical(source).string();
  return (std::filesystem::path(cache_dir) / (std::filesystem::path(source).stem().string() + "-" +
                                              hex32(crc32c(abs.data(), abs.size())) + "." +
                                              std::string(quant::to_string(scheme.bits)) + "-g" +
                                              std::to_string(scheme.group) + ".safetensors"))
      .string();
}

CompressedCache open_compressed_cache(
    const std::string& source, const Header& header, const std::vector<std::string>& names,
    const quant::Scheme& scheme, const std::string& cache_dir, bool verify,
    const std::function<void(std::uint64_t, std::uint64_t)>& progress) {
  CompressedCache c;
  c.path = compressed_cache_path(source, cache_dir, scheme);
  const nlohmann::json key = key_of(source, scheme);
  c.why = why_stale(c.path, key, names, verify);
  if (!c.why.empty()) {
    c.rebuilt = true;
    std::filesystem::create_directories(cache_dir);
    // The layouts first, the CRCs as "00000000" (fixed width): the header is written again with
    // them at the end (Writer::finish(metadata)), so each tensor is read and quantized once.
    Fd src(source);
    nlohmann::json meta = key;
    meta["tensors"] = nlohmann::json::object();
    std::vector<TensorSpec> specs;
    std::vector<quant::Layout> layouts;
    std::uint64_t total = 0;
    for (const std::string& n : names) {
      const TensorInfo& t = header.at(n);
      if (!quant::compressible(t.dtype))
        STRATA_FAIL(Errc::invalid_argument, "tensor '", n, "' in ", source, " is ",
                    to_string(t.dtype), ": only f32, bf16 and f16 tensors can be compressed");
      layouts.push_back(quant::layout(scheme, std::span<const std::int64_t>(t.shape)));
      const std::uint64_t padded = (layouts.back().bytes + kPage - 1) / kPage * kPage;
      total += padded;
      specs.push_back({n, DType::U8, {static_cast<std::int64_t>(padded)}});
      meta["tensors"][n] = {{"dtype", public_name(t.dtype)},
                            {"shape", t.shape},
                            {"stored_bytes", layouts.back().bytes},
                            {"crc32c", hex32(0)}};
    }
    const std::string tmp = c.path + ".tmp" + std::to_string(::getpid());
    try {
      Writer w(tmp, specs, {{"strata", meta.dump()}}, kPage);
      std::vector<std::byte> in, packed;
      std::uint64_t done = 0;
      for (std::size_t i = 0; i < names.size(); ++i) {
        const TensorInfo& t = header.at(names[i]);
        in.resize(t.bytes());
        read_at(src.fd, source, t.offset, in.data(), t.bytes());
        const std::uint64_t padded = static_cast<std::uint64_t>(specs[i].shape[0]);
        packed.assign(padded, std::byte{0});
        quant::quantize(scheme, layouts[i], t.dtype, in.data(), packed.data(), names[i]);
        meta["tensors"][names[i]]["crc32c"] = hex32(crc32c(packed.data(), layouts[i].bytes));
        w.write(packed.data(), padded);
        done += padded;
        if (progress) progress(done, total);
      }
      w.finish({{"strata", meta.dump()}});
      std::filesystem::rename(tmp, c.path);
    } catch (...) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      throw;
    }
  }
  c.header = read_header(c.path);
  const auto meta = nlohmann::json::parse(c.header.metadata.at("strata"));
  for (const auto& [n, info] : meta.at("tensors").items()) {
    c.stored_bytes += info.at("stored_bytes").get<std::uint64_t>();
    c.full_bytes += header.at(n).bytes();
  }
  return c;
}

std::unordered_map<std::string, TensorId> map_compressed(Runtime& runtime,
                                                         const CompressedCache& cache) {
  const auto meta = nlohmann::json::parse(cache.header.metadata.at("strata"));
  const Codec codec =
      quant::codec_of(quant::parse_bits(meta.at("compress").get<std::string>(), "compress"));
  const std::uint32_t group = meta.at("group");
  std::unordered_map<std::string, TensorId> ids;
  try {
    for (const auto& [n, info] : meta.at("tensors").items()) {
      TensorDesc d;
      d.name = n;
      d.dtype = from_public(info.at("dtype").get<std::string>());
      d.shape = info.at("shape").get<std::vector<std::int64_t>>();
      d.kind = TensorKind::Param;
      d.compression = {codec, group};
      ids.emplace(n, runtime.map_tensor(d, cache.path, cache.header.at(n).offset));
    }
  } catch (...) {
    for (const auto& [n, id] : ids)
      runtime.destroy_tensor(id);
    throw;
  }
  return ids;
}

}  // namespace strata::safetensors
