// CUDA KV-cache swap ops. Host memory the GPU can address (mapped pinned) is moved by one kernel
// for both ops; pageable host memory by merged-run cudaMemcpyAsync. Built for sm_80 and sm_90.
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

// One CUDA block moves one 16 KiB chunk of one (pair, layer) block between the device cache and
// host memory the GPU can address (mapped pinned memory). blockIdx.x = pair * nlayers + layer,
// blockIdx.y = chunk. The host copy of layer `l`'s block for pair `p` starts at
// host_layers[l] + host_ids[p] * host_stride, which covers both host layouts: per-layer buffers
// (stride = block_bytes) and the [slot, layer, block] staging layout (base = staging +
// l * block_bytes, stride = nlayers * block_bytes). Each thread issues kUnroll 16-byte loads
// before its stores, so enough requests are in flight to keep PCIe busy.
constexpr int kUnroll = 4;

__global__ void copy_blocks_kernel(const uintptr_t* __restrict__ dev_layers,
                                   const uintptr_t* __restrict__ host_layers,
                                   const int64_t* __restrict__ dev_ids,
                                   const int64_t* __restrict__ host_ids, int nlayers,
                                   int64_t block_bytes, int64_t host_stride, int to_host,
                                   int vec16) {
  const int64_t pair = blockIdx.x / nlayers;
  const int layer = static_cast<int>(blockIdx.x % nlayers);
  char* dev = reinterpret_cast<char*>(dev_layers[layer]) + dev_ids[pair] * block_bytes;
  char* host = reinterpret_cast<char*>(host_layers[layer]) + host_ids[pair] * host_stride;
  char* dst = to_host ? host : dev;
  const char* src = to_host ? dev : host;
  const int64_t lo = static_cast<int64_t>(blockIdx.y) * kChunkBytes;
  const int64_t hi = min(lo + kChunkBytes, block_bytes);
  if (vec16) {
    constexpr int64_t kStep = static_cast<int64_t>(kThreads) * 16;
    for (int64_t base = lo + threadIdx.x * 16; base < hi; base += kStep * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t off = base + u * kStep;
        if (off < hi) v[u] = *reinterpret_cast<const int4*>(src + off);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t off = base + u * kStep;
        if (off < hi) *reinterpret_cast<int4*>(dst + off) = v[u];
      }
    }
  } else {
    for (int64_t off = lo + threadIdx.x; off < hi; off += kThreads) dst[off] = src[off];
  }
}

// The device address of host memory the GPU can reach directly (mapped pinned memory), or
// nullptr for pageable memory, which only the copy engines can read.
void* mapped_address(const void* host) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error of an unknown pointer
    return nullptr;
  }
  if (attr.type == cudaMemoryTypeUnregistered) return nullptr;
  return attr.devicePointer != nullptr ? attr.devicePointer : const_cast<void*>(host);
}

// Launches copy_blocks_kernel with its arguments in one stream-ordered scratch buffer.
int launch_copy_kernel(cudaStream_t s, const uintptr_t* dev_layers,
                       const std::vector<uintptr_t>& host_layers, int nlayers,
                       int64_t block_bytes, int64_t host_stride, const int64_t* dev_ids,
                       const int64_t* host_ids, int64_t n, int to_host, char* err, int errlen) {
  std::vector<int64_t> packed(static_cast<size_t>(2 * nlayers + 2 * n));
  bool vec16 = block_bytes % 16 == 0 && host_stride % 16 == 0;
  for (int l = 0; l < nlayers; ++l) {
    packed[l] = static_cast<int64_t>(dev_layers[l]);
    packed[nlayers + l] = static_cast<int64_t>(host_layers[l]);
    vec16 = vec16 && dev_layers[l] % 16 == 0 && host_layers[l] % 16 == 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    packed[2 * nlayers + i] = dev_ids[i];
    packed[2 * nlayers + n + i] = host_ids[i];
  }
  void* scratch = nullptr;
  const size_t scratch_bytes = packed.size() * sizeof(int64_t);
  KVC_CUDA_TRY(cudaMallocAsync(&scratch, scratch_bytes, s));
  // From pageable memory this returns once `packed` has been staged, so it may go out of scope.
  cudaError_t e = cudaMemcpyAsync(scratch, packed.data(), scratch_bytes, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) {
    const int64_t* a = static_cast<const int64_t*>(scratch);
    dim3 grid(static_cast<unsigned>(n * nlayers),
              static_cast<unsigned>((block_bytes + kChunkBytes - 1) / kChunkBytes));
    copy_blocks_kernel<<<grid, kThreads, 0, s>>>(
        reinterpret_cast<const uintptr_t*>(a), reinterpret_cast<const uintptr_t*>(a + nlayers),
        a + 2 * nlayers, a + 2 * nlayers + n, nlayers, block_bytes, host_stride, to_host,
        vec16 ? 1 : 0);
    e = cudaGetLastError();
  }
  cudaError_t fe = cudaFreeAsync(scratch, s);
  if (e != cudaSuccess) return cuda_err(err, errlen, "copy_blocks_kernel launch", e);
  if (fe != cudaSuccess) return cuda_err(err, errlen, "cudaFreeAsync", fe);
  return KVC_OK;
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
  // Mapped pinned host buffers: one kernel moves every block (a copy per 128 KiB block costs the
  // copy engine about as much in setup as in transfer). Pageable ones: merged runs of memcpy.
  std::vector<uintptr_t> mapped(static_cast<size_t>(nlayers));
  bool all_mapped = true;
  for (int l = 0; l < nlayers && all_mapped; ++l) {
    mapped[l] = reinterpret_cast<uintptr_t>(mapped_address(reinterpret_cast<void*>(host_ptrs[l])));
    all_mapped = mapped[l] != 0;
  }
  if (all_mapped) {
    rc = launch_copy_kernel(s, dev_ptrs, mapped, nlayers, block_bytes, block_bytes, dev_ids,
                            host_ids, n, mode == KVC_TO_HOST, err, errlen);
    if (rc != KVC_OK) return rc;
    if (sync) KVC_CUDA_TRY(cudaStreamSynchronize(s));
    return KVC_OK;
  }
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

  void* staging_dev = mapped_address(reinterpret_cast<void*>(staging));
  if (staging_dev == nullptr) {
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
  // [slot, layer, block]: layer l of slot k is at staging + l * block_bytes + k * slot_bytes
  std::vector<uintptr_t> bases(static_cast<size_t>(nlayers));
  for (int l = 0; l < nlayers; ++l)
    bases[l] = reinterpret_cast<uintptr_t>(staging_dev) + static_cast<uintptr_t>(l * block_bytes);
  rc = launch_copy_kernel(s, layer_ptrs, bases, nlayers, block_bytes, block_bytes * nlayers,
                          dev_ids, slot_ids, n, to_staging, err, errlen);
  if (rc != KVC_OK) return rc;
  if (sync) KVC_CUDA_TRY(cudaStreamSynchronize(s));
  return KVC_OK;
}

}  // extern "C"
