// Setting up an io_uring: the best setup flags the kernel accepts (Note [Dropping setup flags]).
// Used by the io_uring engine only.
#pragma once

#include <liburing.h>

#include <string>

namespace strata::detail {

struct RingSetup {
  int rc = 0;
  std::string flags;  // for describe()
};

/// Initialises `ring` with `entries`, trying the cheapest flags first (and SQPOLL when asked)
/// and dropping them until the kernel accepts; rc < 0 when it accepts none.
RingSetup setup_ring(io_uring* ring, unsigned entries, bool sqpoll);

}  // namespace strata::detail
