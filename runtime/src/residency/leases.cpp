// Lease and LeaseFuture: a tensor's copy held on one tier, and the promise of one. Releasing a
// write lease bumps the tensor's version (Note [Versions]); releasing a claimed copy's last
// lease drops it for its claimant (Note [Arrival in pieces]). Nothing here makes room.
#include <exception>
#include <mutex>
#include <utility>

#include "impl.h"
#include "strata/base/error.h"

namespace strata {

using namespace residency;  // NOLINT(google-build-using-namespace): the core's own records

Lease::Lease(Lease&& o) noexcept {
  *this = std::move(o);
}

Lease& Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    release();
    runtime_ = std::exchange(o.runtime_, nullptr);
    data_ = o.data_;
    bytes_ = o.bytes_;
    tensor_ = o.tensor_;
    tier_ = o.tier_;
    access_ = o.access_;
    event_ = std::move(o.event_);
  }
  return *this;
}

void Lease::wait() const {
  if (event_) event_->synchronize();
}

void Runtime::Impl::end_lease(TensorId tensor, Tier tier, Access held, bool wrote) noexcept {
  Impl& rt = *this;
  {
    std::unique_lock lock(rt.mutex);
    const auto it = rt.tensors.find(tensor);
    if (it != rt.tensors.end()) {
      TensorState& t = *it->second;
      Copy& c = t.copies[idx(tier)];
      if (c.leases > 0) --c.leases;
      if (writes(held) && c.write_leases > 0) --c.write_leases;
      c.last_use = ++rt.clock;
      if (wrote) {
        t.version += 1;  // Note [Versions]: every other copy is now stale
        c.version = t.version;
        t.discarded = false;
      }
      // Note [Arrival in pieces]: a claimed copy goes when its last lease ends; the claimant's
      // chunks into its room start (their I/O after the unlock, and never throws).
      if (tier == Tier::Device && rt.drop_if_claimed(lock, t)) rt.run_after_unlock(lock);
    }
  }
  // Note [Waits]: a copy whose last lease ended may now be evicted; a written one is the newest
  // copy now (a reader may be waiting for a current copy). Nobody else waits on leases.
  rt.room.notify_all();
  if (wrote) rt.settled.notify_all();
}

void Lease::release() noexcept {
  if (runtime_ == nullptr) return;
  runtime_->impl_->end_lease(tensor_, tier_, access_, /*wrote=*/writes(access_));
  runtime_ = nullptr;
  event_.reset();
}

LeaseFuture::LeaseFuture(LeaseFuture&& o) noexcept {
  *this = std::move(o);
}

LeaseFuture& LeaseFuture::operator=(LeaseFuture&& o) noexcept {
  if (this != &o) {
    if (runtime_ != nullptr) runtime_->impl_->end_lease(tensor_, tier_, access_, false);
    runtime_ = std::exchange(o.runtime_, nullptr);
    tensor_ = o.tensor_;
    tier_ = o.tier_;
    access_ = o.access_;
  }
  return *this;
}

// Unclaimed: the lease ends unused (a write lease wrote nothing: the version stays).
LeaseFuture::~LeaseFuture() {
  if (runtime_ != nullptr) runtime_->impl_->end_lease(tensor_, tier_, access_, /*wrote=*/false);
}

bool LeaseFuture::ready() const {
  if (runtime_ == nullptr) return false;
  Runtime::Impl& rt = *runtime_->impl_;
  std::lock_guard lock(rt.mutex);
  const Copy& c = rt.get(tensor_).copies[idx(tier_)];
  return c.ready || c.error != nullptr;
}

Lease LeaseFuture::get() {
  STRATA_EXPECTS(runtime_ != nullptr, "LeaseFuture::get on an empty or used future");
  Runtime::Impl& rt = *runtime_->impl_;
  Lease lease;
  lease.runtime_ = std::exchange(runtime_, nullptr);  // the lease now owns the pin
  lease.tensor_ = tensor_;
  lease.tier_ = tier_;
  lease.access_ = access_;
  std::unique_lock lock(rt.mutex);
  TensorState& t = rt.get(tensor_);
  Copy& c = t.copies[idx(tier_)];
  rt.ready_cv.wait(lock, [&] { return c.ready || c.error != nullptr; });
  if (!c.ready) {
    const std::exception_ptr error = c.error;
    lock.unlock();
    // The copy never arrived: the lease ends having written nothing, whatever its access, so
    // the copy it was loaded from stays the newest (a write lease's release would make this
    // absent copy the only current one, and every later acquire wait for it forever).
    lease.runtime_ = nullptr;
    rt.end_lease(tensor_, tier_, access_, /*wrote=*/false);
    std::rethrow_exception(error);
  }
  lease.data_ = c.ptr;
  lease.bytes_ = t.bytes_on(tier_);
  lease.event_ = c.state == CopyState::Valid ? nullptr : c.event;
  return lease;
}

}  // namespace strata
