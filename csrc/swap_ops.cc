// Host-side KV-cache swap ops: validated, run-merged memcpy split across std::threads.
// (std::thread rather than OpenMP: Paddle already loads two OpenMP runtimes into the process.)
#include "swap_ops.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>  // SSE2: part of every x86-64 CPU
#define KVC_HAVE_STREAMING_STORES 1
#endif

namespace {

constexpr int64_t kSmallCopyBytes = 1 << 20;  // below this one thread is faster
constexpr int64_t kMinChunkBytes = 4096;
constexpr int kMaxThreads = 64;
// A call moving at least this much writes its destination with non-temporal stores (x86-64).
// glibc's memcpy does the same for one large copy, but a gather or scatter is many pieces of a
// block's size (tens of KiB to a few MiB), each below glibc's threshold: with ordinary stores
// every destination line is first read into the cache, which costs one thread ~45 % of its
// copy rate here (224 MiB: 12.8 GB/s as one copy, 6.8-7.8 GB/s as pieces of 32 KiB-16 MiB).
// A destination this large cannot stay in the cache anyway.
constexpr int64_t kStreamingBytes = 32 << 20;

int set_err(char* err, int errlen, int code, const char* fmt, ...) {
  if (err != nullptr && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, static_cast<size_t>(errlen), fmt, ap);
    va_end(ap);
  }
  return code;
}

struct Segment {
  char* dst;
  const char* src;
  int64_t bytes;
};

// memcpy, or with `streaming` a copy whose destination bypasses the cache (16-byte
// non-temporal stores, unaligned head and tail by memcpy). The caller fences.
void copy_bytes(char* dst, const char* src, int64_t len, bool streaming) {
#ifdef KVC_HAVE_STREAMING_STORES
  if (streaming && len >= 256) {
    const int64_t head = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
    std::memcpy(dst, src, static_cast<size_t>(head));
    dst += head;
    src += head;
    len -= head;
    const int64_t body = len & ~static_cast<int64_t>(63);
    for (int64_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + body, src + body, static_cast<size_t>(len - body));
    return;
  }
#else
  (void)streaming;
#endif
  std::memcpy(dst, src, static_cast<size_t>(len));
}

// Non-temporal stores are weakly ordered: make them visible before the copy is reported done.
void store_fence(bool streaming) {
#ifdef KVC_HAVE_STREAMING_STORES
  if (streaming) _mm_sfence();
#else
  (void)streaming;
#endif
}

// Copies all segments; the concatenated byte range is cut into `nthreads` equal pieces, so one
// large run is shared by several threads and many small runs are spread evenly.
void run_segments(const std::vector<Segment>& segs, int nthreads) {
  std::vector<int64_t> starts(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) starts[i + 1] = starts[i] + segs[i].bytes;
  const int64_t total = starts.back();
  const bool streaming = total >= kStreamingBytes;
  if (nthreads <= 1 || total == 0) {
    for (const Segment& s : segs) copy_bytes(s.dst, s.src, s.bytes, streaming);
    store_fence(streaming);
    return;
  }
  auto copy_range = [&segs, &starts, streaming](int64_t lo, int64_t hi) {
    size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) -
                                   starts.begin() - 1);
    while (lo < hi) {
      const int64_t off = lo - starts[k];
      const int64_t len = std::min(hi, starts[k + 1]) - lo;
      copy_bytes(segs[k].dst + off, segs[k].src + off, len, streaming);
      lo += len;
      ++k;
    }
    store_fence(streaming);
  };
  auto bound = [total, nthreads](int t) {
    // Piece boundaries on 4 KiB multiples keep each thread's writes page-aligned.
    const int64_t b = total / nthreads * t;
    return t == nthreads ? total : b - b % kMinChunkBytes;
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(nthreads - 1));
  int t = 0;
  for (; t < nthreads - 1; ++t) {
    try {
      workers.emplace_back(copy_range, bound(t), bound(t + 1));
    } catch (const std::system_error&) {
      break;  // cannot start more threads: this thread copies the rest
    }
  }
  copy_range(bound(t), total);
  for (std::thread& w : workers) w.join();
}

}  // namespace

extern "C" {

int kvc_resolve_threads(int requested, int64_t total_bytes) {
  int n = requested;
  if (n <= 0) {
    const char* env = std::getenv("KVCORE_SWAP_THREADS");
    n = env != nullptr ? std::atoi(env) : 0;
    if (n <= 0) {
      const int hw = static_cast<int>(std::thread::hardware_concurrency());
      n = std::min(4, hw > 0 ? hw : 1);
    }
    if (total_bytes < kSmallCopyBytes) n = 1;
  }
  const int64_t by_size = std::max<int64_t>(1, total_bytes / kMinChunkBytes);
  return static_cast<int>(std::min<int64_t>({n, by_size, kMaxThreads}));
}

int kvc_check_ids(const int64_t* dev_nblocks, int nlayers, const int64_t* dev_ids,
                  const int64_t* other_ids, int64_t n, int64_t other_limit,
                  const char* other_name, int mode, char* err, int errlen) {
  if (mode != KVC_TO_HOST && mode != KVC_TO_DEVICE)
    return set_err(err, errlen, KVC_EINVAL, "mode must be 0 (to host) or 1 (to device), got %d",
                   mode);
  if (n < 0 || nlayers < 0)
    return set_err(err, errlen, KVC_EINVAL, "negative id count or layer count");
  if (n == 0) return KVC_OK;
  if (dev_ids == nullptr || other_ids == nullptr || (nlayers > 0 && dev_nblocks == nullptr))
    return set_err(err, errlen, KVC_EINVAL, "null id array");
  // Smallest block count over layers bounds the shared device ids; name the first short layer.
  int64_t dev_limit = INT64_MAX;
  for (int l = 0; l < nlayers; ++l) dev_limit = std::min(dev_limit, dev_nblocks[l]);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = dev_ids[i];
    if (d < 0 || d >= dev_limit) {
      int layer = 0;
      while (layer < nlayers && d >= 0 && d < dev_nblocks[layer]) ++layer;
      return set_err(err, errlen, KVC_EINVAL,
                     "device_block_ids[%lld]=%lld out of range [0, %lld) of layer %d",
                     static_cast<long long>(i), static_cast<long long>(d),
                     static_cast<long long>(d < 0 ? dev_nblocks[0] : dev_nblocks[layer]), layer);
    }
    const int64_t o = other_ids[i];
    if (o < 0 || (other_limit >= 0 && o >= other_limit)) {
      if (other_limit >= 0)
        return set_err(err, errlen, KVC_EINVAL, "%s[%lld]=%lld out of range [0, %lld)",
                       other_name, static_cast<long long>(i), static_cast<long long>(o),
                       static_cast<long long>(other_limit));
      return set_err(err, errlen, KVC_EINVAL, "%s[%lld]=%lld is negative", other_name,
                     static_cast<long long>(i), static_cast<long long>(o));
    }
  }
  const int64_t* dst = mode == KVC_TO_HOST ? other_ids : dev_ids;
  std::vector<int64_t> sorted(dst, dst + n);
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end())
    return set_err(err, errlen, KVC_EINVAL,
                   "%s contains duplicate destination id %lld (mode %d writes to it twice)",
                   mode == KVC_TO_HOST ? other_name : "device_block_ids",
                   static_cast<long long>(*dup), mode);
  return KVC_OK;
}

int kvc_swap_all_layers(const uintptr_t* dev_ptrs, const uintptr_t* host_ptrs,
                        const int64_t* dev_nblocks, int nlayers, int64_t block_bytes,
                        int64_t host_nblocks, const int64_t* dev_ids, const int64_t* host_ids,
                        int64_t n, int mode, int nthreads, char* err, int errlen) {
  if (block_bytes <= 0)
    return set_err(err, errlen, KVC_EINVAL, "block size must be positive, got %lld bytes",
                   static_cast<long long>(block_bytes));
  if (host_nblocks < 0)
    return set_err(err, errlen, KVC_EINVAL, "max_host_blocks must be >= 0, got %lld",
                   static_cast<long long>(host_nblocks));
  int rc = kvc_check_ids(dev_nblocks, nlayers, dev_ids, host_ids, n, host_nblocks,
                         "host_block_ids", mode, err, errlen);
  if (rc != KVC_OK || n == 0 || nlayers == 0) return rc;
  for (int l = 0; l < nlayers; ++l)
    if (dev_ptrs[l] == 0 || host_ptrs[l] == 0)
      return set_err(err, errlen, KVC_EINVAL, "null pointer for layer %d", l);

  // Runs where both device and host ids advance by one become one copy per layer.
  std::vector<Segment> segs;
  for (int l = 0; l < nlayers; ++l) {
    char* dev = reinterpret_cast<char*>(dev_ptrs[l]);
    char* host = reinterpret_cast<char*>(host_ptrs[l]);
    for (int64_t i = 0; i < n;) {
      int64_t j = i + 1;
      while (j < n && dev_ids[j] == dev_ids[j - 1] + 1 && host_ids[j] == host_ids[j - 1] + 1) ++j;
      char* d = dev + dev_ids[i] * block_bytes;
      char* h = host + host_ids[i] * block_bytes;
      const int64_t bytes = (j - i) * block_bytes;
      segs.push_back(mode == KVC_TO_HOST ? Segment{h, d, bytes} : Segment{d, h, bytes});
      i = j;
    }
  }
  run_segments(segs, kvc_resolve_threads(nthreads, n * nlayers * block_bytes));
  return KVC_OK;
}

int kvc_swap_layout(const uintptr_t* layer_ptrs, const int64_t* layer_nblocks, int nlayers,
                    int64_t block_bytes, uintptr_t staging, int64_t staging_nslots,
                    const int64_t* dev_ids, const int64_t* slot_ids, int64_t n, int mode,
                    int nthreads, char* err, int errlen) {
  if (block_bytes <= 0)
    return set_err(err, errlen, KVC_EINVAL, "block size must be positive, got %lld bytes",
                   static_cast<long long>(block_bytes));
  int rc = kvc_check_ids(layer_nblocks, nlayers, dev_ids, slot_ids, n, staging_nslots,
                         "staging_slot_ids", mode, err, errlen);
  if (rc != KVC_OK || n == 0 || nlayers == 0) return rc;
  if (staging == 0) return set_err(err, errlen, KVC_EINVAL, "staging_ptr is null");
  for (int l = 0; l < nlayers; ++l)
    if (layer_ptrs[l] == 0) return set_err(err, errlen, KVC_EINVAL, "null pointer for layer %d", l);

  // Slot-major order: the staging side is walked sequentially. Consecutive blocks of one layer
  // are one slot apart in staging, so runs only merge when there is a single layer.
  const int64_t slot_bytes = block_bytes * nlayers;
  char* stage = reinterpret_cast<char*>(staging);
  std::vector<Segment> segs;
  segs.reserve(static_cast<size_t>(n * nlayers));
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    if (nlayers == 1)
      while (j < n && dev_ids[j] == dev_ids[j - 1] + 1 && slot_ids[j] == slot_ids[j - 1] + 1) ++j;
    const int64_t bytes = (j - i) * block_bytes;
    for (int l = 0; l < nlayers; ++l) {
      char* d = reinterpret_cast<char*>(layer_ptrs[l]) + dev_ids[i] * block_bytes;
      char* s = stage + slot_ids[i] * slot_bytes + l * block_bytes;
      segs.push_back(mode == KVC_TO_HOST ? Segment{s, d, bytes} : Segment{d, s, bytes});
    }
    i = j;
  }
  run_segments(segs, kvc_resolve_threads(nthreads, n * nlayers * block_bytes));
  return KVC_OK;
}

}  // extern "C"
