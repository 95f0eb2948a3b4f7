/* hello offload: tensors four times larger than the device budget, touched in order and in
 * reverse through the strata C API; every byte is checked. Usage: hello_offload [NVME_DIR] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <strata/strata.h>

#define TENSORS 16
#define TENSOR_BYTES (1u << 20) /* 16 x 1 MiB = 4 x the 4 MiB device budget */

static unsigned char expected(unsigned tensor, unsigned i) {
  return (unsigned char)(tensor * 37u + i * 7u + (i >> 11));
}

static int check(int status, const char* what) {
  if (status != 0) fprintf(stderr, "hello_offload: %s failed (%d): %s\n", what, status, strata_last_error());
  return status;
}

/* On the host backend the lease's pointer could be read directly; on the CUDA backend it is
 * device memory, so the bytes are checked through strata_lease_read (a device-to-host copy). */
static int touch(strata_runtime* rt, const strata_tensor* t, unsigned k, unsigned char* bytes) {
  void* p = NULL;
  if (check(strata_acquire(rt, t[k], STRATA_TIER_DEVICE, STRATA_ACCESS_READ, &p), "acquire")) return 1;
  if (check(strata_lease_read(rt, t[k], STRATA_TIER_DEVICE, bytes, TENSOR_BYTES), "lease_read")) {
    strata_release(rt, t[k], STRATA_TIER_DEVICE);
    return 1;
  }
  for (unsigned i = 0; i < TENSOR_BYTES; ++i) {
    if (bytes[i] != expected(k, i)) {
      fprintf(stderr, "hello_offload: tensor %u byte %u is %u, expected %u\n", k, i, bytes[i], expected(k, i));
      strata_release(rt, t[k], STRATA_TIER_DEVICE);
      return 1;
    }
  }
  return check(strata_release(rt, t[k], STRATA_TIER_DEVICE), "release");
}

int main(int argc, char** argv) {
  char dir[] = "/var/tmp/strata-hello-XXXXXX";
  const char* nvme = argc > 1 ? argv[1] : mkdtemp(dir);
  if (nvme == NULL) { perror("mkdtemp"); return 1; }
  char config[1024];
  snprintf(config, sizeof config,
           "{\"backend\": \"auto\", \"device_budget\": \"4MiB\", \"host_budget\": \"8MiB\","
           " \"staging_chunk\": \"1MiB\", \"io\": {\"block\": \"1MiB\"},"
           " \"nvme\": {\"paths\": [\"%s\"], \"capacity\": \"64MiB\"}}", nvme);
  strata_runtime* rt = NULL;
  if (check(strata_runtime_create(config, &rt), "strata_runtime_create")) return 1;

  strata_tensor t[TENSORS];
  unsigned char* init = malloc(TENSOR_BYTES);
  int failed = 0;
  for (unsigned k = 0; k < TENSORS && !failed; ++k) {
    for (unsigned i = 0; i < TENSOR_BYTES; ++i) init[i] = expected(k, i);
    char name[32];
    snprintf(name, sizeof name, "layer.%u", k);
    failed = check(strata_tensor_create(rt, name, TENSOR_BYTES, STRATA_TIER_NVME, init, &t[k]), "create");
  }
  for (unsigned k = 0; k < TENSORS && !failed; ++k) failed = touch(rt, t, k, init);
  for (unsigned k = TENSORS; k-- > 0 && !failed;) failed = touch(rt, t, k, init);
  free(init);

  uint64_t needed = 0;
  strata_stats_json(rt, NULL, 0, &needed); /* ask for the size first */
  char* stats = malloc(needed);
  if (!failed && check(strata_stats_json(rt, stats, needed, &needed), "stats")) failed = 1;
  if (!failed) printf("hello_offload: %d tensors x %u bytes, every byte checked twice\n%s\n", TENSORS, TENSOR_BYTES, stats);
  free(stats);
  strata_runtime_destroy(rt);
  if (argc <= 1) rmdir(dir);
  return failed ? 1 : 0;
}
