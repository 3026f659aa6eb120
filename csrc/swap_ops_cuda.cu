// CUDA KV-cache swap ops: merged-run cudaMemcpyAsync for per-layer swaps and a gather/scatter
// kernel for the [slot, layer, block] staging layout. Built for sm_80 and sm_90.
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <vector>

#include "swap_ops_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = 16 * 1024;  // bytes of one block moved by one CUDA block

int set_err(char* err, int errlen, int code, const char* fmt, ...) {
  if (err != nullptr && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, static_cast<size_t>(errlen), fmt, ap);
    va_end(ap);
  }
  return code;
}

int cuda_err(char* err, int errlen, const char* what, cudaError_t e) {
  return set_err(err, errlen, KVC_ERUNTIME, "%s: %s (error %d)", what, cudaGetErrorString(e),
                 static_cast<int>(e));
}

#define KVC_CUDA_TRY(call)                                       \
  do {                                                           \
    cudaError_t e_ = (call);                                     \
    if (e_ != cudaSuccess) return cuda_err(err, errlen, #call, e_); \
  } while (0)

// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&prev_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool ok_ = false;
};

// blockIdx.x = pair * nlayers + layer, blockIdx.y = chunk of the block. Copies 16 bytes per
// thread-iteration when all addresses and the size allow it (the usual case), else bytes.
__global__ void layout_kernel(const uintptr_t* __restrict__ layer_ptrs,
                              const int64_t* __restrict__ dev_ids,
                              const int64_t* __restrict__ slot_ids, int nlayers,
                              int64_t block_bytes, char* staging, int to_staging, int vec16) {
  const int64_t pair = blockIdx.x / nlayers;
  const int layer = static_cast<int>(blockIdx.x % nlayers);
  char* dev = reinterpret_cast<char*>(layer_ptrs[layer]) + dev_ids[pair] * block_bytes;
  char* stg = staging + (slot_ids[pair] * nlayers + layer) * block_bytes;
  char* dst = to_staging ? stg : dev;
  const char* src = to_staging ? dev : stg;
  const int64_t lo = static_cast<int64_t>(blockIdx.y) * kChunkBytes;
  const int64_t hi = min(lo + kChunkBytes, block_bytes);
  if (vec16) {
    for (int64_t off = lo + threadIdx.x * 16; off < hi; off += kThreads * 16)
      *reinterpret_cast<int4*>(dst + off) = *reinterpret_cast<const int4*>(src + off);
  } else {
    for (int64_t off = lo + threadIdx.x; off < hi; off += kThreads) dst[off] = src[off];
  }
}

}  // namespace

extern "C" {

int kvc_cuda_device_count(int* count, char* err, int errlen) {
  *count = 0;
  KVC_CUDA_TRY(cudaGetDeviceCount(count));
  return KVC_OK;
}

int kvc_cuda_host_alloc(int64_t nbytes, uintptr_t* out, char* err, int errlen) {
  void* p = nullptr;
  if (nbytes <= 0) return set_err(err, errlen, KVC_EINVAL, "nbytes must be positive");
  // Portable + mapped: usable from every device, and kernels may read/write it directly.
  KVC_CUDA_TRY(cudaHostAlloc(&p, static_cast<size_t>(nbytes),
                             cudaHostAllocPortable | cudaHostAllocMapped));
  *out = reinterpret_cast<uintptr_t>(p);
  return KVC_OK;
}

int kvc_cuda_host_free(uintptr_t ptr, char* err, int errlen) {
  KVC_CUDA_TRY(cudaFreeHost(reinterpret_cast<void*>(ptr)));
  return KVC_OK;
}

int kvc_cuda_malloc(int device, int64_t nbytes, uintptr_t* out, char* err, int errlen) {
  DeviceGuard guard;
  void* p = nullptr;
  KVC_CUDA_TRY(cudaSetDevice(device));
  KVC_CUDA_TRY(cudaMalloc(&p, static_cast<size_t>(nbytes)));
  *out = reinterpret_cast<uintptr_t>(p);
  return KVC_OK;
}

int kvc_cuda_free(uintptr_t ptr, char* err, int errlen) {
  KVC_CUDA_TRY(cudaFree(reinterpret_cast<void*>(ptr)));
  return KVC_OK;
}

int kvc_cuda_memcpy(uintptr_t dst, uintptr_t src, int64_t nbytes, char* err, int errlen) {
  KVC_CUDA_TRY(cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                          static_cast<size_t>(nbytes), cudaMemcpyDefault));
  return KVC_OK;
}

int kvc_cuda_synchronize(int device, char* err, int errlen) {
  DeviceGuard guard;
  KVC_CUDA_TRY(cudaSetDevice(device));
  KVC_CUDA_TRY(cudaDeviceSynchronize());
  return KVC_OK;
}

int kvc_cuda_swap_all_layers(int device, uintptr_t stream, const uintptr_t* dev_ptrs,
                             const uintptr_t* host_ptrs, const int64_t* dev_nblocks, int nlayers,
                             int64_t block_bytes, int64_t host_nblocks, const int64_t* dev_ids,
                             const int64_t* host_ids, int64_t n, int mode, int sync, char* err,
                             int errlen) {
  if (block_bytes <= 0) return set_err(err, errlen, KVC_EINVAL, "block size must be positive");
  int rc = kvc_check_ids(dev_nblocks, nlayers, dev_ids, host_ids, n, host_nblocks,
                         "host_block_ids", mode, err, errlen);
  if (rc != KVC_OK || n == 0 || nlayers == 0) return rc;
  DeviceGuard guard;
  KVC_CUDA_TRY(cudaSetDevice(device));
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  for (int l = 0; l < nlayers; ++l) {
    char* dev = reinterpret_cast<char*>(dev_ptrs[l]);
    char* host = reinterpret_cast<char*>(host_ptrs[l]);
    for (int64_t i = 0; i < n;) {
      int64_t j = i + 1;
      while (j < n && dev_ids[j] == dev_ids[j - 1] + 1 && host_ids[j] == host_ids[j - 1] + 1) ++j;
      char* d = dev + dev_ids[i] * block_bytes;
      char* h = host + host_ids[i] * block_bytes;
      const size_t bytes = static_cast<size_t>((j - i) * block_bytes);
      if (mode == KVC_TO_HOST)
        KVC_CUDA_TRY(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, s));
      else
        KVC_CUDA_TRY(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));
      i = j;
    }
  }
  if (sync) KVC_CUDA_TRY(cudaStreamSynchronize(s));
  return KVC_OK;
}

int kvc_cuda_swap_layout(int device, uintptr_t stream, const uintptr_t* layer_ptrs,
                         const int64_t* layer_nblocks, int nlayers, int64_t block_bytes,
                         uintptr_t staging, int64_t staging_nslots, const int64_t* dev_ids,
                         const int64_t* slot_ids, int64_t n, int mode, int sync, char* err,
                         int errlen) {
  if (block_bytes <= 0) return set_err(err, errlen, KVC_EINVAL, "block size must be positive");
  int rc = kvc_check_ids(layer_nblocks, nlayers, dev_ids, slot_ids, n, staging_nslots,
                         "staging_slot_ids", mode, err, errlen);
  if (rc != KVC_OK || n == 0 || nlayers == 0) return rc;
  if (staging == 0) return set_err(err, errlen, KVC_EINVAL, "staging_ptr is null");
  DeviceGuard guard;
  KVC_CUDA_TRY(cudaSetDevice(device));
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int to_staging = mode == KVC_TO_HOST;

  cudaPointerAttributes attr;
  KVC_CUDA_TRY(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(staging)));
  if (attr.type == cudaMemoryTypeUnregistered) {
    // Pageable staging: the kernel cannot touch it, so copy block by block.
    const int64_t slot_bytes = block_bytes * nlayers;
    for (int64_t i = 0; i < n; ++i) {
      for (int l = 0; l < nlayers; ++l) {
        char* d = reinterpret_cast<char*>(layer_ptrs[l]) + dev_ids[i] * block_bytes;
        char* h = reinterpret_cast<char*>(staging) + slot_ids[i] * slot_bytes + l * block_bytes;
        KVC_CUDA_TRY(cudaMemcpyAsync(to_staging ? h : d, to_staging ? d : h,
                                     static_cast<size_t>(block_bytes), cudaMemcpyDefault, s));
      }
    }
    if (sync) KVC_CUDA_TRY(cudaStreamSynchronize(s));
    return KVC_OK;
  }
  // Mapped pinned memory has a device address equal to the host one under UVA, but ask anyway.
  void* staging_dev = attr.devicePointer != nullptr ? attr.devicePointer
                                                    : reinterpret_cast<void*>(staging);

  // Kernel arguments: [layer_ptrs | dev_ids | slot_ids] in one stream-ordered scratch buffer.
  std::vector<int64_t> packed(static_cast<size_t>(nlayers + 2 * n));
  bool vec16 = block_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(staging_dev) % 16 == 0;
  for (int l = 0; l < nlayers; ++l) {
    packed[l] = static_cast<int64_t>(layer_ptrs[l]);
    vec16 = vec16 && layer_ptrs[l] % 16 == 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    packed[nlayers + i] = dev_ids[i];
    packed[nlayers + n + i] = slot_ids[i];
  }
  void* scratch = nullptr;
  const size_t scratch_bytes = packed.size() * sizeof(int64_t);
  KVC_CUDA_TRY(cudaMallocAsync(&scratch, scratch_bytes, s));
  // From pageable memory this returns once `packed` has been staged, so it may go out of scope.
  cudaError_t e = cudaMemcpyAsync(scratch, packed.data(), scratch_bytes, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) {
    const int64_t* ids = static_cast<const int64_t*>(scratch);
    dim3 grid(static_cast<unsigned>(n * nlayers),
              static_cast<unsigned>((block_bytes + kChunkBytes - 1) / kChunkBytes));
    layout_kernel<<<grid, kThreads, 0, s>>>(reinterpret_cast<const uintptr_t*>(ids), ids + nlayers,
                                            ids + nlayers + n, nlayers, block_bytes,
                                            static_cast<char*>(staging_dev), to_staging,
                                            vec16 ? 1 : 0);
    e = cudaGetLastError();
  }
  cudaError_t fe = cudaFreeAsync(scratch, s);
  if (e != cudaSuccess) return cuda_err(err, errlen, "layout_kernel launch", e);
  if (fe != cudaSuccess) return cuda_err(err, errlen, "cudaFreeAsync", fe);
  if (sync) KVC_CUDA_TRY(cudaStreamSynchronize(s));
  return KVC_OK;
}

}  // extern "C"
