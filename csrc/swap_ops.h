// C ABI of the host-side KV-cache swap ops (used by kvcore._swap and the CUDA library).
//
// All pointers are raw byte addresses passed as uintptr_t; sizes are in bytes. Every entry point
// validates its ids and returns a status code instead of crashing; on error a NUL-terminated
// message naming the offending argument is written into `err` (if non-null).
#ifndef KVCORE_SWAP_OPS_H_
#define KVCORE_SWAP_OPS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  KVC_OK = 0,
  KVC_EINVAL = 1,   // bad argument (ids out of range, duplicate destinations, ...)
  KVC_ERUNTIME = 2  // runtime failure (CUDA error, thread creation failure, ...)
};

// Modes: which side is the destination.
enum { KVC_TO_HOST = 0, KVC_TO_DEVICE = 1 };

// Validate id pairs: lengths n, device ids checked per layer against dev_nblocks[layer],
// other ids against [0, other_limit) (other_limit < 0: only non-negativity is checked).
// Duplicate destination ids (host/slot ids in mode 0, device ids in mode 1) are rejected since
// their result would depend on copy order. `other_name` names the non-device id argument.
int kvc_check_ids(const int64_t* dev_nblocks, int nlayers, const int64_t* dev_ids,
                  const int64_t* other_ids, int64_t n, int64_t other_limit,
                  const char* other_name, int mode, char* err, int errlen);

// Per-layer swap between device cache tensors and per-layer host buffers with the same layout.
// Copies block dev_ids[i] <-> host block host_ids[i] of every layer; runs of ids consecutive on
// both sides are merged into one copy. nthreads <= 0 picks the default (KVCORE_SWAP_THREADS or
// min(4, hardware threads)); copies below ~1 MiB always run single-threaded.
int kvc_swap_all_layers(const uintptr_t* dev_ptrs, const uintptr_t* host_ptrs,
                        const int64_t* dev_nblocks, int nlayers, int64_t block_bytes,
                        int64_t host_nblocks, const int64_t* dev_ids, const int64_t* host_ids,
                        int64_t n, int mode, int nthreads, char* err, int errlen);

// Gather (mode 0) the selected blocks of all layers into a staging buffer laid out
// [slot, layer, block] or scatter (mode 1) them back. One slot is nlayers * block_bytes bytes.
// staging_nslots < 0 means the staging size is unknown (only non-negative slot ids checked).
int kvc_swap_layout(const uintptr_t* layer_ptrs, const int64_t* layer_nblocks, int nlayers,
                    int64_t block_bytes, uintptr_t staging, int64_t staging_nslots,
                    const int64_t* dev_ids, const int64_t* slot_ids, int64_t n, int mode,
                    int nthreads, char* err, int errlen);

// Thread count used for a copy of `total_bytes`: requested > 0 is honoured (at most one thread
// per 4 KiB, at most 64); otherwise KVCORE_SWAP_THREADS or min(4, hardware threads), and one
// thread below 1 MiB where thread start-up would cost more than it saves.
int kvc_resolve_threads(int requested, int64_t total_bytes);

#ifdef __cplusplus
}
#endif

#endif  // KVCORE_SWAP_OPS_H_
