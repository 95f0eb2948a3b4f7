// Setting up an io_uring (Note [Dropping setup flags]): the cheapest flags the kernel accepts.
#include "uring_setup.h"

#include <cerrno>

namespace strata::detail {

// Note [Dropping setup flags]: newer flags make the ring cheaper (no IPIs for task work, one
// issuer), but older kernels reject them with EINVAL. Try the best set first and drop flags until
// the kernel accepts, as fio does; only a refusal of io_uring itself (ENOSYS, EPERM) is fatal.
RingSetup setup_ring(io_uring* ring, unsigned entries, bool sqpoll) {
  struct Candidate {
    unsigned flags;
    const char* name;
  };
  static constexpr Candidate kCandidates[] = {
      {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, "single_issuer,defer_taskrun"},
      {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN, "single_issuer,coop_taskrun"},
      {IORING_SETUP_COOP_TASKRUN, "coop_taskrun"},
      {0, "plain"},
  };
  RingSetup out;
  for (const bool sq : {sqpoll, false}) {
    for (const Candidate& c : kCandidates) {
      io_uring_params params{};
      params.flags = c.flags;
      if (sq) {
        params.flags = (c.flags & ~IORING_SETUP_DEFER_TASKRUN) | IORING_SETUP_SQPOLL;
        params.sq_thread_idle = 1000;
      }
      out.rc = io_uring_queue_init_params(entries, ring, &params);
      if (out.rc == 0) {
        out.flags = std::string(sq ? "sqpoll," : "") + c.name;
        return out;
      }
      if (out.rc != -EINVAL && !(sq && out.rc == -EPERM)) return out;
    }
    if (!sqpoll) break;
  }
  return out;
}

}  // namespace strata::detail
