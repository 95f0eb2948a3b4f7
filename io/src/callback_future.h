// Internal: an IoCallback bound to a future, for the future-returning overloads.
#pragma once

#include <future>
#include <memory>
#include <utility>

#include "strata/io/io_engine.h"

namespace strata::detail {

/// A callback that fulfils the returned future: set_value on success, the error otherwise.
inline std::pair<IoCallback, std::future<void>> callback_with_future() {
  auto promise = std::make_shared<std::promise<void>>();
  std::future<void> future = promise->get_future();
  IoCallback callback = [promise](std::exception_ptr error) {
    if (error)
      promise->set_exception(error);
    else
      promise->set_value();
  };
  return {std::move(callback), std::move(future)};
}

}  // namespace strata::detail
