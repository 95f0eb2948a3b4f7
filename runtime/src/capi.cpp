// The C API: a thin layer over strata::Runtime that turns exceptions into status codes and a
// per-thread message.
#include "strata/strata.h"

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "strata/base/error.h"
#include "strata/runtime/runtime.h"
#include "strata/runtime/telemetry.h"

struct strata_runtime {
  std::unique_ptr<strata::Runtime> runtime;
  std::mutex mutex;  // guards leases
  std::map<std::pair<strata_tensor, int>, std::vector<strata::Lease>> leases;
};

namespace {

thread_local std::string g_last_error;

int fail(int code, std::string message) {
  g_last_error = std::move(message);
  return code;
}

// Runs `body`, mapping exceptions to status codes.
template <typename F>
int guarded(F&& body) {
  try {
    g_last_error.clear();
    body();
    return STRATA_OK;
  } catch (const strata::Error& e) {
    return fail(-static_cast<int>(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(STRATA_ERROR_OUT_OF_MEMORY, "out of host memory (std::bad_alloc)");
  } catch (const std::exception& e) {
    return fail(STRATA_ERROR_INTERNAL, e.what());
  } catch (...) {
    return fail(STRATA_ERROR_INTERNAL, "unknown error");
  }
}

strata::Tier tier_of(strata_tier tier) {
  STRATA_EXPECTS(tier == STRATA_TIER_DEVICE || tier == STRATA_TIER_HOST || tier == STRATA_TIER_NVME,
                 "tier: ", static_cast<int>(tier), " is not a strata_tier");
  return static_cast<strata::Tier>(tier);
}

strata::Access access_of(strata_access access) {
  STRATA_EXPECTS(access >= STRATA_ACCESS_READ && access <= STRATA_ACCESS_READ_WRITE,
                 "access: ", static_cast<int>(access), " is not a strata_access");
  return static_cast<strata::Access>(access);
}

#define STRATA_C_REQUIRE(ptr) STRATA_EXPECTS((ptr) != nullptr, __func__, ": ", #ptr, " is NULL")

}  // namespace

extern "C" {

int strata_runtime_create(const char* config_json, strata_runtime** out) {
  return guarded([&] {
    STRATA_C_REQUIRE(out);
    *out = nullptr;
    auto rt = std::make_unique<strata_runtime>();
    rt->runtime = strata::Runtime::from_json(
        config_json != nullptr && config_json[0] != '\0' ? config_json : "{}");
    *out = rt.release();
  });
}

void strata_runtime_destroy(strata_runtime* rt) {
  if (rt == nullptr) return;
  {
    std::lock_guard lock(rt->mutex);
    rt->leases.clear();
  }
  delete rt;
}

int strata_tensor_create(strata_runtime* rt, const char* name, uint64_t bytes, strata_tier home,
                         const void* init, strata_tensor* out) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    STRATA_C_REQUIRE(out);
    strata::TensorDesc desc;
    desc.name = name != nullptr ? name : "";
    desc.bytes = bytes;
    *out = rt->runtime->create_tensor(desc, tier_of(home), init);
  });
}

int strata_tensor_destroy(strata_runtime* rt, strata_tensor t) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    rt->runtime->destroy_tensor(t);
  });
}

int strata_acquire(strata_runtime* rt, strata_tensor t, strata_tier tier, strata_access access,
                   void** ptr) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    STRATA_C_REQUIRE(ptr);
    strata::Lease lease = rt->runtime->acquire(t, tier_of(tier), access_of(access)).get();
    lease.wait();
    *ptr = lease.data();
    std::lock_guard lock(rt->mutex);
    rt->leases[{t, static_cast<int>(tier)}].push_back(std::move(lease));
  });
}

int strata_lease_read(strata_runtime* rt, strata_tensor t, strata_tier tier, void* dst,
                      uint64_t bytes) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    STRATA_C_REQUIRE(dst);
    std::lock_guard lock(rt->mutex);
    const auto it = rt->leases.find({t, static_cast<int>(tier)});
    STRATA_EXPECTS(it != rt->leases.end() && !it->second.empty(), "strata_lease_read: tensor ", t,
                   " holds no lease on tier ", static_cast<int>(tier));
    const strata::Lease& lease = it->second.back();
    STRATA_EXPECTS(bytes <= lease.bytes(), "strata_lease_read: ", bytes,
                   " bytes asked of a lease of ", lease.bytes());
    strata::Backend& backend = rt->runtime->backend();
    if (lease.tier() == strata::Tier::Device && !backend.info().host_addressable) {
      backend.copy(dst, lease.data(), bytes, strata::CopyKind::DeviceToHost);
    } else {
      std::memcpy(dst, lease.data(), bytes);
    }
  });
}

int strata_release(strata_runtime* rt, strata_tensor t, strata_tier tier) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    strata::Lease lease;
    {
      std::lock_guard lock(rt->mutex);
      const auto it = rt->leases.find({t, static_cast<int>(tier)});
      STRATA_EXPECTS(it != rt->leases.end() && !it->second.empty(), "strata_release: tensor ", t,
                     " holds no lease on tier ", static_cast<int>(tier));
      lease = std::move(it->second.back());
      it->second.pop_back();
      if (it->second.empty()) rt->leases.erase(it);
    }
    lease.release();
  });
}

int strata_prefetch(strata_runtime* rt, strata_tensor t, strata_tier tier) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    rt->runtime->prefetch(t, tier_of(tier));
  });
}

int strata_evict(strata_runtime* rt, strata_tensor t, strata_tier tier) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    rt->runtime->evict(t, tier_of(tier));
  });
}

int strata_tensor_read(strata_runtime* rt, strata_tensor t, void* dst, uint64_t bytes) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    STRATA_C_REQUIRE(dst);
    rt->runtime->read(t, dst, bytes);
  });
}

int strata_tensor_write(strata_runtime* rt, strata_tensor t, const void* src, uint64_t bytes) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    STRATA_C_REQUIRE(src);
    rt->runtime->write(t, src, bytes);
  });
}

int strata_stats_json(strata_runtime* rt, char* buf, uint64_t capacity, uint64_t* needed) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    const std::string json = rt->runtime->stats_json();
    if (needed != nullptr) *needed = json.size() + 1;
    STRATA_EXPECTS(buf != nullptr && capacity >= json.size() + 1,
                   "strata_stats_json: the buffer holds ", capacity, " bytes; ", json.size() + 1,
                   " are needed");
    std::memcpy(buf, json.c_str(), json.size() + 1);
  });
}

int strata_trace_export(strata_runtime* rt, const char* path) {
  return guarded([&] {
    STRATA_C_REQUIRE(rt);
    STRATA_C_REQUIRE(path);
    rt->runtime->telemetry().write_chrome_trace(path);
  });
}

const char* strata_last_error(void) {
  return g_last_error.c_str();
}

}  // extern "C"
