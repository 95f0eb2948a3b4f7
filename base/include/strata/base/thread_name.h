// Names the calling thread as `top -H`, gdb and perf show it ("strata-io", "strata-h2d"): the
// one place strata's own threads are named, so a user can tell them from compute threads.
#pragma once

#include <pthread.h>

#include <string>
#include <string_view>

namespace strata {

/// Sets the calling thread's name to "strata-" + `what`, cut to the 15 characters Linux keeps.
/// Best effort: a failure leaves the name as it was.
inline void name_this_thread(std::string_view what) noexcept {
  try {
    std::string name = "strata-";
    name.append(what);
    if (name.size() > 15) name.resize(15);
    ::pthread_setname_np(::pthread_self(), name.c_str());
  } catch (...) {
  }
}

}  // namespace strata
