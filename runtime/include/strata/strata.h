/* strata C API, for FFI (Python ctypes, Rust, ...).
 *
 * Every function returns 0 on success and a negative strata_status otherwise;
 * strata_last_error() then returns the calling thread's message, which names the problem (the
 * key, the file, the tier, how much was asked and free). Functions are thread-safe.
 * On the host backend a device pointer is host-addressable; on the CUDA backend it is a device
 * pointer. */
#ifndef STRATA_STRATA_H
#define STRATA_STRATA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct strata_runtime strata_runtime;
typedef uint64_t strata_tensor;
typedef enum { STRATA_TIER_DEVICE = 0, STRATA_TIER_HOST = 1, STRATA_TIER_NVME = 2 } strata_tier;
typedef enum {
  STRATA_ACCESS_READ = 1,
  STRATA_ACCESS_WRITE = 2, /* write-discard: every byte is overwritten, nothing is loaded */
  STRATA_ACCESS_READ_WRITE = 3
} strata_access;

/* Negative return values (the negation of the C++ strata::Errc). */
typedef enum {
  STRATA_OK = 0,
  STRATA_ERROR_INVALID_ARGUMENT = -1,
  STRATA_ERROR_OUT_OF_MEMORY = -2,
  STRATA_ERROR_IO = -3,
  STRATA_ERROR_CORRUPT_DATA = -4,
  STRATA_ERROR_CUDA = -5,
  STRATA_ERROR_UNSUPPORTED = -6,
  STRATA_ERROR_NOT_FOUND = -7,
  STRATA_ERROR_INTERNAL = -8
} strata_status;

/* Creates a runtime from a JSON configuration (NULL or "" for defaults; keys in the README). */
int strata_runtime_create(const char* config_json, strata_runtime** out);
/* Destroys the runtime; leases still held are released first. NULL is ignored. */
void strata_runtime_destroy(strata_runtime* rt);

/* A tensor of `bytes` homed on `home`, holding `init` (bytes long) or zeros when init is NULL. */
int strata_tensor_create(strata_runtime* rt, const char* name, uint64_t bytes, strata_tier home,
                         const void* init, strata_tensor* out);
int strata_tensor_destroy(strata_runtime* rt, strata_tensor t);

/* Leases the tensor on `tier` (DEVICE or HOST) and blocks until its bytes are there; *ptr points
 * at them until the matching strata_release. Leases nest: each acquire needs one release. */
int strata_acquire(strata_runtime* rt, strata_tensor t, strata_tier tier, strata_access access,
                   void** ptr);
/* Copies the first `bytes` of the most recent lease of `t` on `tier` into host memory `dst`:
 * a lease on the CUDA device tier is device memory the host cannot read through its pointer, so
 * this is how C code checks it (a device-to-host copy there, a plain copy elsewhere). */
int strata_lease_read(strata_runtime* rt, strata_tensor t, strata_tier tier, void* dst,
                      uint64_t bytes);
/* Releases the most recent lease of `t` on `tier`. */
int strata_release(strata_runtime* rt, strata_tensor t, strata_tier tier);
/* Starts moving `t` to `tier` and returns. */
int strata_prefetch(strata_runtime* rt, strata_tensor t, strata_tier tier);
/* Demotes `t` from `tier` (writing it back below first if it is the newest copy). */
int strata_evict(strata_runtime* rt, strata_tensor t, strata_tier tier);
/* Copies the tensor's newest bytes to `dst` (bytes <= its size) / replaces them from `src`
 * (bytes == its size). */
int strata_tensor_read(strata_runtime* rt, strata_tensor t, void* dst, uint64_t bytes);
int strata_tensor_write(strata_runtime* rt, strata_tensor t, const void* src, uint64_t bytes);

/* Writes the statistics as a NUL-terminated JSON object into buf. *needed receives the size
 * with the NUL; when capacity is smaller, nothing is written and STRATA_ERROR_INVALID_ARGUMENT
 * is returned, so a caller can ask with capacity 0 first. */
int strata_stats_json(strata_runtime* rt, char* buf, uint64_t capacity, uint64_t* needed);
/* Writes the Chrome trace (Perfetto, chrome://tracing) of the recorded events to `path`. */
int strata_trace_export(strata_runtime* rt, const char* path);

/* The calling thread's last error message ("" when there was none). Valid until the thread's
 * next strata call. */
const char* strata_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* STRATA_STRATA_H */
