// Links the installed strata, makes a host backend, moves bytes through the device tier and back.
#include <cstdio>
#include <cstring>
#include <vector>

#include <strata/base/units.h>
#include <strata/runtime/backend.h>

int main() {
  strata::BackendOptions options;
  options.kind = strata::BackendKind::Host;
  options.device_budget_bytes = strata::parse_bytes("8MiB");
  auto backend = strata::make_backend(options);
  std::vector<unsigned char> in(1 << 20), out(1 << 20);
  for (std::size_t i = 0; i < in.size(); ++i)
    in[i] = static_cast<unsigned char>(i * 7);
  void* device = backend->allocate_device(in.size());
  backend->h2d_stream().copy_async(device, in.data(), in.size(), strata::CopyKind::HostToDevice);
  backend->h2d_stream().synchronize();
  backend->copy(out.data(), device, out.size(), strata::CopyKind::DeviceToHost);
  backend->deallocate_device(device);
  const bool same = std::memcmp(in.data(), out.data(), in.size()) == 0;
  std::printf("consumer: %s round trip through %s\n", same ? "exact" : "WRONG",
              backend->info().name.c_str());
  return same ? 0 : 1;
}
