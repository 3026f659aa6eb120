// C ABI of the CUDA KV-cache swap ops (library kvcore/_swap_cuda.so, loaded with ctypes).
//
// Streams are cudaStream_t values passed as uintptr_t (0 = legacy default stream). Ids are
// validated on the host with kvc_check_ids before anything is queued. Return codes as in
// swap_ops.h; CUDA failures return KVC_ERUNTIME with "<call>: <cudaGetErrorString> (error N)".
#ifndef KVCORE_SWAP_OPS_CUDA_H_
#define KVCORE_SWAP_OPS_CUDA_H_

#include <stdint.h>

#include "swap_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

int kvc_cuda_device_count(int* count, char* err, int errlen);

// Pinned (page-locked, device-mapped) host memory.
int kvc_cuda_host_alloc(int64_t nbytes, uintptr_t* out, char* err, int errlen);
int kvc_cuda_host_free(uintptr_t ptr, char* err, int errlen);

// Device memory and a synchronous copy (cudaMemcpyDefault): helpers for tests and benchmarks
// that run without a framework.
int kvc_cuda_malloc(int device, int64_t nbytes, uintptr_t* out, char* err, int errlen);
int kvc_cuda_free(uintptr_t ptr, char* err, int errlen);
int kvc_cuda_memcpy(uintptr_t dst, uintptr_t src, int64_t nbytes, char* err, int errlen);
int kvc_cuda_synchronize(int device, char* err, int errlen);

// Same semantics as kvc_swap_all_layers: one cudaMemcpyAsync per merged run and layer on
// `stream`. sync != 0 waits for the stream before returning.
int kvc_cuda_swap_all_layers(int device, uintptr_t stream, const uintptr_t* dev_ptrs,
                             const uintptr_t* host_ptrs, const int64_t* dev_nblocks, int nlayers,
                             int64_t block_bytes, int64_t host_nblocks, const int64_t* dev_ids,
                             const int64_t* host_ids, int64_t n, int mode, int sync, char* err,
                             int errlen);

// Same semantics as kvc_swap_layout. A gather/scatter kernel moves all blocks in one launch when
// the staging buffer is device-accessible (device memory or pinned host memory); pageable
// staging falls back to one cudaMemcpyAsync per block and layer.
int kvc_cuda_swap_layout(int device, uintptr_t stream, const uintptr_t* layer_ptrs,
                         const int64_t* layer_nblocks, int nlayers, int64_t block_bytes,
                         uintptr_t staging, int64_t staging_nslots, const int64_t* dev_ids,
                         const int64_t* slot_ids, int64_t n, int mode, int sync, char* err,
                         int errlen);

#ifdef __cplusplus
}
#endif

#endif  // KVCORE_SWAP_OPS_CUDA_H_
