// Test helpers for the io layer: temporary directories on a real disk, a small tmpfs, patterns.
#pragma once

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "strata/io/pages.h"

namespace strata::testing {

/// A fresh directory, removed with its contents at scope exit. Made under $STRATA_TEST_DIR, else
/// $TMPDIR, else /var/tmp (a disk filesystem, so O_DIRECT works; /tmp may be tmpfs).
class TempDir {
 public:
  explicit TempDir(const std::string& base = {}) {
    std::string root = base;
    if (root.empty()) {
      for (const char* env : {"STRATA_TEST_DIR", "TMPDIR"})
        if (const char* v = std::getenv(env); v != nullptr && *v != '\0') {
          root = v;
          break;
        }
    }
    if (root.empty()) root = "/var/tmp";
    std::string tmpl = root + "/strata-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed in " + root);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// A memory filesystem mounted on a fresh directory (needs root): a tmpfs of `bytes` (for a real
/// ENOSPC), or a ramfs (bytes = 0; a filesystem that refuses O_DIRECT). mounted() says whether
/// it worked, and why_not() why not.
class SmallTmpfs {
 public:
  explicit SmallTmpfs(std::size_t bytes) {
    const char* type = bytes > 0 ? "tmpfs" : "ramfs";
    const std::string opts = bytes > 0 ? "size=" + std::to_string(bytes) : "";
    if (::mount(type, dir_.path().c_str(), type, 0, opts.c_str()) == 0)
      mounted_ = true;
    else
      why_not_ = std::string("mount ") + type + ": " + std::strerror(errno) + " (not root?)";
  }
  ~SmallTmpfs() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  [[nodiscard]] bool mounted() const { return mounted_; }
  [[nodiscard]] const std::string& why_not() const { return why_not_; }
  [[nodiscard]] const std::string& path() const { return dir_.path(); }

 private:
  TempDir dir_;
  bool mounted_ = false;
  std::string why_not_;
};

/// A whole file's bytes; empty when it cannot be read.
inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// How many times `what` occurs in `text` (overlapping occurrences counted).
inline std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++n;
  return n;
}

/// Writes `bytes` as the whole file at `path`.
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline void fill_pattern(void* data, std::size_t bytes, unsigned seed) {
  auto* p = static_cast<unsigned char*>(data);
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (std::size_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<unsigned char>(x >> 24);
  }
}

inline std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> out(bytes);
  fill_pattern(out.data(), bytes, seed);
  return out;
}

}  // namespace strata::testing
