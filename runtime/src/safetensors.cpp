#include "strata/runtime/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "strata/base/error.h"

namespace strata::safetensors {
namespace {

using nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";

struct TooDeep {};  // thrown by the parse callback

// The format's dtype spellings: those strata computes with, and those it knows but refuses.
struct DTypeName {
  std::string_view name;
  DType dtype;
};
constexpr std::array<DTypeName, 10> kDTypes{{{"F64", DType::F64},
                                             {"F32", DType::F32},
                                             {"F16", DType::F16},
                                             {"BF16", DType::BF16},
                                             {"I64", DType::I64},
                                             {"I32", DType::I32},
                                             {"I16", DType::I16},
                                             {"I8", DType::I8},
                                             {"U8", DType::U8},
                                             {"BOOL", DType::Bool}}};
constexpr std::array<std::string_view, 11> kKnownUnsupported{
    "U16",     "U32",     "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0",
    "F6_E2M3", "F6_E3M2", "F4",  "C64",     "C128"};

std::string_view format_name(DType d) {
  for (const DTypeName& n : kDTypes)
    if (n.dtype == d) return n.name;
  return "?";
}

class Parser {
 public:
  Parser(std::uint64_t file_bytes, std::string_view source)
      : file_bytes_(file_bytes), source_(source.empty() ? "safetensors" : source) {}

  template <typename... Args>
  [[noreturn]] void fail(Args&&... args) const {
    throw Error(Errc::corrupt_data, detail::concat(source_, ": ", std::forward<Args>(args)...));
  }
  template <typename... Args>
  [[noreturn]] void fail_tensor(const std::string& name, Args&&... args) const {
    fail("tensor \"", name, "\": ", std::forward<Args>(args)...);
  }

  Header parse(std::string_view text) {
    Header h;
    h.header_bytes = text.size();
    h.file_bytes = file_bytes_;
    h.data_offset = 8 + h.header_bytes;
    if (h.data_offset > file_bytes_)
      fail("header of ", h.header_bytes, " bytes runs past the end of the file (", file_bytes_,
           " bytes)");
    const std::uint64_t data_bytes = file_bytes_ - h.data_offset;
    const json doc = parse_json(text);
    if (!doc.is_object()) fail("the header is not a JSON object");
    for (const auto& [key, value] : doc.items()) {
      if (key == kMetadataKey) {
        metadata(value, h);
        continue;
      }
      h.tensors.push_back(tensor(key, value, data_bytes, h.data_offset));
    }
    std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    // Tensors tile the data section: no overlap, no hole.
    std::uint64_t covered = 0;
    const TensorInfo* previous = nullptr;
    for (const TensorInfo& t : h.tensors) {
      if (t.begin < covered)
        fail_tensor(t.name, "data_offsets [", t.begin, ", ", t.end, "] overlap tensor \"",
                    previous->name, "\" [", previous->begin, ", ", previous->end, "]");
      if (t.begin > covered)
        fail_tensor(t.name, "data_offsets [", t.begin, ", ", t.end, "] leave a hole of ",
                    t.begin - covered, " bytes at data offset ", covered,
                    " (the data section must be covered entirely)");
      covered = t.end;
      previous = &t;
    }
    if (covered != data_bytes)
      fail("the data section has ", data_bytes, " bytes but the tensors cover ", covered,
           covered < data_bytes ? " (trailing bytes no tensor owns)" : "");
    return h;
  }

 private:
  json parse_json(std::string_view text) const {
    // Keys of the top-level object must be unique, and nothing may nest deeper than a
    // tensor entry's arrays: checked while parsing, before anything large is built.
    std::set<std::string> keys;
    std::string duplicate;
    auto check = [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth > 3) throw TooDeep{};
      if (event == json::parse_event_t::key && depth == 1) {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!keys.insert(k).second && duplicate.empty()) duplicate = k;
      }
      return true;
    };
    try {
      json doc = json::parse(text.begin(), text.end(), check, /*allow_exceptions=*/true);
      if (!duplicate.empty()) fail("tensor \"", duplicate, "\" appears twice in the header");
      return doc;
    } catch (const json::exception& e) {
      fail("the header is not valid JSON: ", e.what());
    } catch (const TooDeep&) {
      fail("the header nests deeper than a safetensors header can (depth > 3)");
    }
  }

  void metadata(const json& value, Header& h) const {
    if (!value.is_object()) fail("__metadata__ is not an object of strings");
    for (const auto& [k, v] : value.items()) {
      if (!v.is_string()) fail("__metadata__ \"", k, "\" is not a string");
      h.metadata.emplace(k, v.get<std::string>());
    }
  }

  static bool unsigned_integer(const json& v, std::uint64_t& out) {
    if (v.is_number_unsigned()) {
      out = v.get<std::uint64_t>();
      return true;
    }
    if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
      out = static_cast<std::uint64_t>(v.get<std::int64_t>());
      return true;
    }
    return false;
  }

  TensorInfo tensor(const std::string& name, const json& v, std::uint64_t data_bytes,
                    std::uint64_t data_offset) const {
    TensorInfo t;
    t.name = name;
    if (!v.is_object()) fail_tensor(name, "its entry is not an object");
    for (const auto& [k, unused] : v.items()) {
      (void)unused;
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        fail_tensor(name, "unknown key \"", k, "\" (expected dtype, shape, data_offsets)");
    }
    // dtype
    const auto dt = v.find("dtype");
    if (dt == v.end()) fail_tensor(name, "no dtype");
    if (!dt->is_string()) fail_tensor(name, "dtype is not a string");
    const std::string& dtype = dt->get_ref<const std::string&>();
    const auto known = std::find_if(kDTypes.begin(), kDTypes.end(),
                                    [&](const DTypeName& n) { return n.name == dtype; });
    if (known == kDTypes.end()) {
      if (std::find(kKnownUnsupported.begin(), kKnownUnsupported.end(), dtype) !=
          kKnownUnsupported.end())
        fail_tensor(name, "dtype ", dtype, " is not supported by strata");
      fail_tensor(name, "unknown dtype \"", dtype, "\"");
    }
    t.dtype = known->dtype;
    // shape
    const auto sh = v.find("shape");
    if (sh == v.end()) fail_tensor(name, "no shape");
    if (!sh->is_array()) fail_tensor(name, "shape is not an array");
    std::uint64_t elements = 1;
    bool overflow = false;
    for (const json& d : *sh) {
      std::uint64_t n = 0;
      if (!unsigned_integer(d, n) || n > static_cast<std::uint64_t>(INT64_MAX))
        fail_tensor(name, "shape ", sh->dump(), " has an entry that is not a non-negative integer");
      t.shape.push_back(static_cast<std::int64_t>(n));
      overflow = overflow || __builtin_mul_overflow(elements, n, &elements);
    }
    std::uint64_t expected = 0;
    overflow = overflow || __builtin_mul_overflow(elements, dtype_bytes(t.dtype), &expected);
    if (overflow) fail_tensor(name, "shape ", sh->dump(), " holds more bytes than 2^64");
    // data_offsets
    const auto off = v.find("data_offsets");
    if (off == v.end()) fail_tensor(name, "no data_offsets");
    if (!off->is_array() || off->size() != 2 || !unsigned_integer((*off)[0], t.begin) ||
        !unsigned_integer((*off)[1], t.end))
      fail_tensor(name, "data_offsets ", off->dump(), " is not [begin, end] of two integers >= 0");
    if (t.end < t.begin)
      fail_tensor(name, "data_offsets [", t.begin, ", ", t.end, "] end before they begin");
    if (t.end > data_bytes)
      fail_tensor(name, "data_offsets [", t.begin, ", ", t.end,
                  "] run past the end of the data section (", data_bytes, " bytes)");
    if (t.bytes() != expected)
      fail_tensor(name, "data_offsets [", t.begin, ", ", t.end, "] hold ", t.bytes(),
                  " bytes but dtype ", dtype, " and shape ", sh->dump(), " need ", expected);
    t.offset = data_offset + t.begin;
    return t;
  }

  std::uint64_t file_bytes_;
  std::string source_;
};

std::uint64_t load_le64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

std::uint64_t check_length(std::uint64_t n, std::uint64_t file_bytes, std::string_view source) {
  const std::string src(source.empty() ? "safetensors" : source);
  if (file_bytes < 8)
    throw Error(Errc::corrupt_data,
                detail::concat(src, ": ", file_bytes,
                               " bytes is too short for a safetensors file (8-byte header "
                               "length, then the header)"));
  if (n > kMaxHeaderBytes)
    throw Error(Errc::corrupt_data, detail::concat(src, ": header length ", n, " exceeds the ",
                                                   kMaxHeaderBytes, "-byte limit"));
  if (n > file_bytes - 8)
    throw Error(Errc::corrupt_data,
                detail::concat(src, ": header length ", n, " runs past the end of the file (",
                               file_bytes, " bytes)"));
  return n;
}

void write_all(int fd, const std::string& path, std::uint64_t offset, const void* data,
               std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(Errc::io_error, path, offset + done, bytes - done, errno, "write");
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace

TensorDesc TensorInfo::desc(TensorKind kind) const {
  TensorDesc d;
  d.name = name;
  d.bytes = bytes();
  d.dtype = dtype;
  d.shape = shape;
  d.kind = kind;
  return d;
}

const TensorInfo* Header::find(std::string_view name) const {
  for (const TensorInfo& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorInfo& Header::at(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) STRATA_FAIL(Errc::not_found, "tensor \"", name, "\" is not in the file");
  return *t;
}

Header parse_header(std::string_view json_text, std::uint64_t file_bytes, std::string_view source) {
  return Parser(file_bytes, source).parse(json_text);
}

Header parse_image(std::string_view image, std::string_view source) {
  const std::uint64_t n =
      image.size() >= 8 ? load_le64(reinterpret_cast<const unsigned char*>(image.data())) : 0;
  check_length(n, image.size(), source);
  return parse_header(image.substr(8, n), image.size(), source);
}

Header read_header(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(Errc::io_error, path, 0, 0, errno, "open");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError(Errc::io_error, path, 0, 0, errno, "fstat");
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  auto read_exact = [&](void* dst, std::size_t bytes, std::uint64_t offset) {
    std::size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd, static_cast<char*>(dst) + done, bytes - done,
                                static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw IoError(Errc::io_error, path, offset + done, bytes - done, errno, "read");
      if (n == 0)
        throw IoError(Errc::corrupt_data, path, offset + done, bytes - done, 0,
                      "read (the file ended early)");
      done += static_cast<std::size_t>(n);
    }
  };
  unsigned char length[8] = {};
  if (file_bytes >= 8) read_exact(length, 8, 0);
  const std::uint64_t n = check_length(file_bytes >= 8 ? load_le64(length) : 0, file_bytes, path);
  std::string text(n, '\0');
  read_exact(text.data(), n, 8);
  return parse_header(text, file_bytes, path);
}

// ---- Writer ----

Writer::Writer(const std::string& path, std::vector<TensorSpec> tensors,
               const std::map<std::string, std::string>& metadata, std::uint64_t data_alignment)
    : path_(path) {
  STRATA_EXPECTS(data_alignment >= 8 && (data_alignment & (data_alignment - 1)) == 0,
                 "safetensors writer: data alignment ", data_alignment,
                 " is not a power of two of at least 8");
  std::set<std::string> seen;
  for (const TensorSpec& t : tensors) {
    STRATA_EXPECTS(t.name != kMetadataKey && seen.insert(t.name).second,
                   "safetensors writer: ", "tensor name \"", t.name, "\" is reserved or repeated");
    std::uint64_t bytes = dtype_bytes(t.dtype);
    for (std::int64_t d : t.shape) {
      STRATA_EXPECTS(d >= 0, "safetensors writer: tensor \"", t.name, "\" has a negative dim");
      bytes *= static_cast<std::uint64_t>(d);
    }
    names_.push_back(t.name);
    sizes_.push_back(bytes);
  }
  specs_ = std::move(tensors);
  alignment_ = data_alignment;
  const std::string text = header_text(metadata);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(Errc::io_error, path, 0, 0, errno, "create");
  unsigned char length[8];
  std::uint64_t n = text.size();
  for (unsigned char& b : length) {
    b = static_cast<unsigned char>(n & 0xff);
    n >>= 8;
  }
  write_all(fd_, path_, 0, length, 8);
  write_all(fd_, path_, 8, text.data(), text.size());
  total_ = data_offset_ = 8 + text.size();
  while (current_ < sizes_.size() && sizes_[current_] == 0)
    ++current_;
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
}

void Writer::write(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    STRATA_EXPECTS(current_ < sizes_.size(), "safetensors writer ", path_,
                   ": more bytes than the tensors hold");
    const std::uint64_t room = sizes_[current_] - written_in_current_;
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(room, bytes));
    write_all(fd_, path_, total_, p, n);
    p += n;
    bytes -= n;
    total_ += n;
    written_in_current_ += n;
    if (written_in_current_ == sizes_[current_]) {
      written_in_current_ = 0;
      ++current_;
      while (current_ < sizes_.size() && sizes_[current_] == 0)
        ++current_;
    }
  }
}

std::string Writer::header_text(const std::map<std::string, std::string>& metadata) const {
  json header = json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    header[specs_[i].name] = {{"dtype", format_name(specs_[i].dtype)},
                              {"shape", specs_[i].shape},
                              {"data_offsets", {offset, offset + sizes_[i]}}};
    offset += sizes_[i];
  }
  std::string text = header.dump();
  // Spaces after the JSON (the format allows them) so that the data starts aligned.
  text.append((alignment_ - (8 + text.size()) % alignment_) % alignment_, ' ');
  return text;
}

void Writer::finish(const std::map<std::string, std::string>& metadata) {
  const std::string text = header_text(metadata);
  STRATA_EXPECTS(8 + text.size() == data_offset_, "safetensors writer ", path_,
                 ": the final metadata makes a header of ", text.size(),
                 " bytes, the one written has ", data_offset_ - 8);
  for (std::size_t done = 0; done < text.size();) {  // over the first header, in place
    const ssize_t n =
        ::pwrite(fd_, text.data() + done, text.size() - done, static_cast<off_t>(8 + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(Errc::io_error, path_, 8 + done, text.size() - done, errno, "pwrite");
    done += static_cast<std::size_t>(n);
  }
  finish();
}

void Writer::finish() {
  STRATA_EXPECTS(current_ == sizes_.size(), "safetensors writer ", path_, ": tensor \"",
                 current_ < names_.size() ? names_[current_] : "", "\" is missing ",
                 current_ < sizes_.size() ? sizes_[current_] - written_in_current_ : 0, " bytes");
  if (::fsync(fd_) != 0) throw IoError(Errc::io_error, path_, 0, total_, errno, "fsync");
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) throw IoError(Errc::io_error, path_, 0, total_, errno, "close");
}

}  // namespace strata::safetensors
