// Typed-test plumbing: every backend test runs once per backend. The host backend always runs;
// the CUDA one skips, saying why, when this build or machine has no usable device.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "strata/runtime/backend.h"

namespace strata::testing {

struct HostBackendParam {
  static constexpr BackendKind kind = BackendKind::Host;
  static std::string unavailable() { return {}; }
};

struct CudaBackendParam {
  static constexpr BackendKind kind = BackendKind::Cuda;
  static std::string unavailable() {
    std::string why;
    if (cuda_device_count(&why) > 0) return {};
    return "no usable CUDA device (" + why + "); the CUDA backend is tested by bench/gpu-check.sh";
  }
};

template <typename Param>
class BackendTest : public ::testing::Test {
 protected:
  static constexpr std::size_t kBudget = 64 << 20;

  void SetUp() override {
    if (const std::string why = Param::unavailable(); !why.empty()) GTEST_SKIP() << why;
    backend_ = make(kBudget);
  }
  static std::unique_ptr<Backend> make(std::size_t budget, double link_gbps = 0.0) {
    BackendOptions options;
    options.kind = Param::kind;
    options.device_budget_bytes = budget;
    options.link_gbps = link_gbps;
    return make_backend(options);
  }
  Backend& backend() { return *backend_; }

  std::unique_ptr<Backend> backend_;
};

using BackendParams = ::testing::Types<HostBackendParam, CudaBackendParam>;

class BackendParamNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return T::kind == BackendKind::Host ? "host" : "cuda";
  }
};

}  // namespace strata::testing
