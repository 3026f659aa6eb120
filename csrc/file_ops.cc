// Native file reads: see file_ops.h.
#include "file_ops.h"
#include "thread_buffer.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>  // rename
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#if __has_include(<xxhash.h>)
#define XXH_INLINE_ALL  // compiled in: the library needs no libxxhash at run time
#include <xxhash.h>
#define KVC_HAVE_XXH3 1
#else
#define KVC_HAVE_XXH3 0
#endif

// digest_avx2.cc, digest_avx512.cc: xxh3's kernels for CPUs that have them (built where the
// compiler can)
extern "C" int kvc_digest_built_avx2(void);
extern "C" void kvc_xxh3_128_update_avx2(void* state, const void* data, size_t len);
extern "C" int kvc_digest_built_avx512(void);
extern "C" void kvc_xxh3_128_update_avx512(void* state, const void* data, size_t len);

#ifndef __NR_cachestat
#define __NR_cachestat 451  // Linux 6.5, the same number on every architecture
#endif

namespace {

constexpr int64_t kPage = 4096;
constexpr size_t kIovMax = 1024;  // Linux's IOV_MAX
// Bytes moved and hashed at a time when a payload is checksummed: small enough to still be in
// the CPU's cache when it is hashed after the copy (or copied after it is hashed), so memory
// is walked once instead of twice; large enough that the calls cost nothing beside the copy.
constexpr size_t kWindow = 256 * 1024;

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

struct CacheStatRange {
  uint64_t off, len;  // len 0: to the end of the file
};
struct CacheStat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

// 1: the page cache holds the file, as its first and last pages tell; 0: it does not; -1:
// cachestat failed (errno). Two pages, not the whole file: cachestat walks every page of its
// range, which took 26 us for a 3.5 MiB file on tmpfs (small folios) against 0.7 us for one
// page, 6 % of a warm read's CPU. A file read or written whole enters the page cache in order
// and leaves it oldest first, so one that lost pages lost its first ones, and one never read
// whole lacks its last ones. A file missing only middle pages reads buffered: the same bytes.
// A file of up to kWholeProbePages pages is asked about whole, in one call that costs less.
constexpr int64_t kWholeProbePages = 24;

int page_cache_holds(int fd, int64_t size) {
  CacheStat stat{};
  if (size <= kWholeProbePages * kPage) {
    CacheStatRange whole{0, 0};
    if (syscall(__NR_cachestat, fd, &whole, &stat, 0) != 0) return -1;
    return static_cast<int64_t>(stat.nr_cache) * kPage >= size ? 1 : 0;
  }
  for (const int64_t offset : {int64_t{0}, (size - 1) / kPage * kPage}) {
    CacheStatRange page{static_cast<uint64_t>(offset), static_cast<uint64_t>(kPage)};
    if (syscall(__NR_cachestat, fd, &page, &stat, 0) != 0) return -1;
    if (stat.nr_cache == 0) return 0;
  }
  return 1;
}

bool page_aligned(int64_t head_len, const struct iovec* pieces, int npieces) {
  if (head_len % kPage != 0) return false;
  for (int i = 0; i < npieces; ++i) {
    if (reinterpret_cast<uintptr_t>(pieces[i].iov_base) % kPage != 0 ||
        pieces[i].iov_len % kPage != 0)
      return false;
  }
  return true;
}

// Past the `moved` bytes a vectored call moved from iov[first..]: the index of the first entry
// not wholly moved, that entry trimmed to what is left of it.
size_t advance(std::vector<struct iovec>& iov, size_t first, size_t moved) {
  while (first < iov.size() && moved >= iov[first].iov_len) {
    moved -= iov[first].iov_len;
    ++first;
  }
  if (moved != 0) {
    iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + moved;
    iov[first].iov_len -= moved;
  }
  return first;
}

// Read the file from `offset` into `iov` (consumed), IOV_MAX entries a call, through short
// reads, up to the end of the file. Returns the bytes read, or -1 with errno set. A read short
// of the end is continued rather than taken for a short file: the kernel copies up to a buffer
// it cannot write (a bad pointer) and the next call reports that error.
int64_t preadv_all(int fd, std::vector<struct iovec>& iov, int64_t offset = 0) {
  size_t first = 0;
  int64_t done = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min(kIovMax, iov.size() - first));
    const ssize_t got = preadv(fd, &iov[first], count, offset + done);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (got == 0) break;  // the end of the file
    done += got;
    first = advance(iov, first, static_cast<size_t>(got));
  }
  return done;
}

// Write `iov` (consumed) in order at `offset` (-1: at the file's position), IOV_MAX entries a
// call, through short writes. 0 or errno.
int writev_all(int fd, std::vector<struct iovec>& iov, int64_t offset = -1) {
  size_t first = 0;
  int64_t done = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min(kIovMax, iov.size() - first));
    const ssize_t put = offset < 0 ? writev(fd, &iov[first], count)
                                   : pwritev(fd, &iov[first], count, offset + done);
    if (put < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    done += put;
    first = advance(iov, first, static_cast<size_t>(put));
  }
  return 0;
}

// The payload's pieces cut into windows of about kWindow bytes (at most IOV_MAX entries each),
// in order: what is moved and hashed at a time.
class Windows {
 public:
  Windows(const struct iovec* pieces, int npieces) : pieces_(pieces), npieces_(npieces) {}

  // The next window into `out` and its bytes; false past the last piece.
  bool next(std::vector<struct iovec>& out, size_t* bytes) {
    out.clear();
    *bytes = 0;
    if (piece_ >= npieces_) return false;
    while (piece_ < npieces_ && *bytes < kWindow && out.size() < kIovMax) {
      const struct iovec& p = pieces_[piece_];
      const size_t take = std::min(p.iov_len - within_, kWindow - *bytes);
      out.push_back({static_cast<char*>(p.iov_base) + within_, take});
      *bytes += take;
      within_ += take;
      if (within_ == p.iov_len) {
        ++piece_;
        within_ = 0;
      }
    }
    return true;
  }

 private:
  const struct iovec* pieces_;
  int npieces_;
  int piece_ = 0;
  size_t within_ = 0;
};

#if KVC_HAVE_XXH3
using DigestUpdate = void (*)(void* state, const void* data, size_t len);

void update_baseline(void* state, const void* data, size_t len) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state), data, len);
}

struct DigestKernel {
  DigestUpdate update;
  const char* name;
};

// The fastest xxh3 kernel this CPU runs (the same digest from each): measured here, AVX-512
// 89 GB/s, AVX2 61, the SSE2 baseline 34 (64 KiB in the CPU's cache).
DigestKernel pick_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (kvc_digest_built_avx512() && __builtin_cpu_supports("avx512f"))
    return {kvc_xxh3_128_update_avx512, "avx512"};
  if (kvc_digest_built_avx2() && __builtin_cpu_supports("avx2"))
    return {kvc_xxh3_128_update_avx2, "avx2"};
#endif
  return {update_baseline, "baseline"};
}

const DigestKernel kernel = pick_kernel();
const DigestUpdate digest_update = kernel.update;

// xxh3-128 of prefix, payload length (8 bytes, little-endian) and payload, fed in order.
class PayloadDigest {
 public:
  PayloadDigest(const void* prefix, int64_t prefix_len, int64_t payload_len) {
    XXH3_INITSTATE(&state_);
    XXH3_128bits_reset(&state_);
    XXH3_128bits_update(&state_, prefix, static_cast<size_t>(prefix_len));
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(payload_len >> (8 * i));
    XXH3_128bits_update(&state_, length, sizeof(length));
  }
  // Hash `window` but its first `*skip` bytes (the file's head, not payload), which it counts
  // down.
  void update(const std::vector<struct iovec>& window, size_t* skip) {
    for (const auto& v : window) {
      if (*skip >= v.iov_len) {
        *skip -= v.iov_len;
        continue;
      }
      digest_update(&state_, static_cast<const char*>(v.iov_base) + *skip, v.iov_len - *skip);
      *skip = 0;
    }
  }
  void finish(uint8_t out[16]) {
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state_));
    memcpy(out, canonical.digest, 16);
  }

 private:
  XXH3_state_t state_;
};

// The digest of a payload already in memory, in one pass.
void digest_payload(const void* prefix, int64_t prefix_len, const struct iovec* pieces,
                    int npieces, int64_t payload_len, uint8_t out[16]) {
  PayloadDigest digest(prefix, prefix_len, payload_len);
  Windows windows(pieces, npieces);
  std::vector<struct iovec> window;
  size_t bytes = 0, skip = 0;
  while (windows.next(window, &bytes)) digest.update(window, &skip);
  digest.finish(out);
}

// Read the whole file (head and payload: `file`) window by window, hashing the payload of each
// window as soon as it arrived. The bytes read (short: the end of the file), or -1 with errno.
int64_t read_hashing(int fd, const std::vector<struct iovec>& file, size_t head_len,
                     PayloadDigest& digest) {
  Windows windows(file.data(), static_cast<int>(file.size()));
  std::vector<struct iovec> window, io;
  size_t bytes = 0, skip = head_len;
  int64_t done = 0;
  while (windows.next(window, &bytes)) {
    io = window;
    const int64_t got = preadv_all(fd, io, done);
    if (got < 0) return -1;
    done += got;
    if (static_cast<size_t>(got) != bytes) return done;
    digest.update(window, &skip);
  }
  return done;
}

// Hash and write the payload at `offset` window by window. 0 or errno.
int write_hashing(int fd, int64_t offset, const struct iovec* pieces, int npieces,
                  PayloadDigest& digest) {
  Windows windows(pieces, npieces);
  std::vector<struct iovec> window, io;
  size_t bytes = 0, skip = 0;
  int64_t done = 0;
  while (windows.next(window, &bytes)) {
    digest.update(window, &skip);
    io = window;
    const int err = writev_all(fd, io, offset + done);
    if (err != 0) return err;
    done += static_cast<int64_t>(bytes);
  }
  return 0;
}
#endif

}  // namespace

extern "C" int kvc_file_ops_have_digest(void) { return KVC_HAVE_XXH3; }

extern "C" int kvc_write_payload(const char* temp, int64_t head_len, const void* prefix,
                                 int64_t prefix_len, const struct iovec* pieces, int npieces,
                                 uint8_t digest[16], int* fd_out) {
  *fd_out = -1;
#if KVC_HAVE_XXH3
  const int fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return errno;
  int64_t payload_len = 0;
  for (int i = 0; i < npieces; ++i) payload_len += static_cast<int64_t>(pieces[i].iov_len);
  PayloadDigest hashed(prefix, prefix_len, payload_len);
  const int err = write_hashing(fd, head_len, pieces, npieces, hashed);
  if (err != 0) {
    close(fd);
    unlink(temp);
    return err;
  }
  hashed.finish(digest);
  *fd_out = fd;
  return 0;
#else
  (void)temp;
  (void)head_len;
  (void)prefix;
  (void)prefix_len;
  (void)pieces;
  (void)npieces;
  (void)digest;
  return ENOSYS;
#endif
}

extern "C" int kvc_finish_write(int fd, const char* temp, const char* path, const void* head,
                                int64_t head_len, int sync) {
  std::vector<struct iovec> iov{{const_cast<void*>(head), static_cast<size_t>(head_len)}};
  int err = writev_all(fd, iov, 0);
  if (err == 0 && sync && fdatasync(fd) != 0) err = errno;
  if (close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && rename(temp, path) != 0) err = errno;
  if (err != 0) unlink(temp);
  return err;
}

extern "C" void kvc_abandon_write(int fd, const char* temp) {
  close(fd);
  unlink(temp);
}

extern "C" uint64_t kvc_stamp(const void* data, size_t len) {
#if KVC_HAVE_XXH3
  return XXH3_64bits(data, len);
#else
  (void)data;
  (void)len;
  return 0;
#endif
}

extern "C" int kvc_digest_pieces(const void* prefix, int64_t prefix_len,
                                 const struct iovec* pieces, int npieces, uint8_t out[16]) {
#if KVC_HAVE_XXH3
  int64_t payload_len = 0;
  for (int i = 0; i < npieces; ++i) payload_len += static_cast<int64_t>(pieces[i].iov_len);
  digest_payload(prefix, prefix_len, pieces, npieces, payload_len, out);
  return 0;
#else
  (void)prefix;
  (void)prefix_len;
  (void)pieces;
  (void)npieces;
  (void)out;
  return ENOSYS;
#endif
}

extern "C" const char* kvc_file_ops_digest_kernel(void) {
#if KVC_HAVE_XXH3
  return kernel.name;
#else
  return "none";
#endif
}

extern "C" int kvc_read_file(const char* path, void* head, int64_t head_len,
                             const struct iovec* pieces, int npieces, int direct,
                             const void* prefix, int64_t prefix_len, uint8_t digest_out[16],
                             int* err_no, int* used_direct) {
  *err_no = 0;
  *used_direct = 0;
  const int raw_fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (raw_fd < 0) return errno == ENOENT ? KVC_READ_MISSING : KVC_READ_OTHER;
  FileDescriptor fd(raw_fd);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) {
    *err_no = errno;
    return KVC_READ_ERRNO;
  }
  int64_t payload_len = 0;
  for (int i = 0; i < npieces; ++i) payload_len += static_cast<int64_t>(pieces[i].iov_len);
  const int64_t total = head_len + payload_len;
  if (!S_ISREG(st.st_mode) || st.st_size != total) return KVC_READ_OTHER;

  bool go_direct = false;
  if (direct) {
    const int cached = page_cache_holds(fd.get(), total);
    if (cached < 0) {
      *err_no = errno;
      return KVC_READ_DIRECT_REFUSED;
    }
    go_direct = cached == 0 && page_aligned(head_len, pieces, npieces);
  }
  void* head_target = head;
  if (go_direct) {
    // the caller's head buffer need not be aligned: the head lands here first
    head_target = kvc::thread_page_buffer<kvc::kDirectHead>(head_len);
    if (head_target == nullptr) {
      *err_no = ENOMEM;
      return KVC_READ_ERRNO;
    }
    const int flags = fcntl(fd.get(), F_GETFL);
    if (flags < 0 || fcntl(fd.get(), F_SETFL, flags | O_DIRECT) != 0) {
      *err_no = errno;
      return KVC_READ_DIRECT_REFUSED;  // some FUSE and network file systems
    }
  }
#if KVC_HAVE_XXH3
  if (prefix != nullptr && !go_direct) {
    // buffered (from the page cache): each window hashed right after its copy; an object of
    // one window is one call, as before
    std::vector<struct iovec> file;
    file.reserve(static_cast<size_t>(npieces) + 1);
    file.push_back({head, static_cast<size_t>(head_len)});
    file.insert(file.end(), pieces, pieces + npieces);
    PayloadDigest digest(prefix, prefix_len, payload_len);
    const int64_t got = read_hashing(fd.get(), file, static_cast<size_t>(head_len), digest);
    if (got < 0) {
      *err_no = errno;
      return KVC_READ_ERRNO;
    }
    if (got != total) return KVC_READ_OTHER;  // shrank since the fstat
    digest.finish(digest_out);
    return KVC_READ_OK;
  }
#endif
  std::vector<struct iovec> iov;
  iov.reserve(static_cast<size_t>(npieces) + 1);
  iov.push_back({head_target, static_cast<size_t>(head_len)});
  iov.insert(iov.end(), pieces, pieces + npieces);
  const int64_t got = preadv_all(fd.get(), iov);
  if (got < 0) {
    *err_no = errno;
    // accepted at open, refused on read: the file system's alignment rules
    return go_direct && errno == EINVAL ? KVC_READ_DIRECT_REFUSED : KVC_READ_ERRNO;
  }
  if (got != total) return KVC_READ_OTHER;  // shrank since the fstat
  if (go_direct) {
    memcpy(head, head_target, static_cast<size_t>(head_len));
    *used_direct = 1;
  }
  if (prefix != nullptr) {
#if KVC_HAVE_XXH3
    // a direct read bypassed the CPU's cache: one pass to hash what arrived
    digest_payload(prefix, prefix_len, pieces, npieces, payload_len, digest_out);
#else
    (void)prefix_len;
    memset(digest_out, 0, 16);
#endif
  }
  return KVC_READ_OK;
}

extern "C" int kvc_write_file(const char* temp, const char* path, void* head, int64_t head_len,
                              int64_t digest_offset, const void* prefix, int64_t prefix_len,
                              const struct iovec* pieces, int npieces, int sync) {
#if !KVC_HAVE_XXH3
  if (digest_offset >= 0) return ENOSYS;
  (void)prefix;
  (void)prefix_len;
#endif
  if (digest_offset >= 0 && digest_offset + 16 > head_len) return EINVAL;
  const int fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return errno;
  int err = 0;
  int64_t payload_len = 0;
  for (int i = 0; i < npieces; ++i) payload_len += static_cast<int64_t>(pieces[i].iov_len);
#if KVC_HAVE_XXH3
  if (digest_offset >= 0 && payload_len > static_cast<int64_t>(kWindow) && !sync) {
    // each window hashed, then copied to the page cache while still in the CPU's cache; the
    // head, holding the digest, last (the temp file is renamed only once it is whole). Not
    // for synced writes: the device is their limit, and one call per object cost less CPU
    // there (measured: 1.09-1.11x raw's CPU per GB against 1.22-1.24x windowed)
    PayloadDigest digest(prefix, prefix_len, payload_len);
    err = write_hashing(fd, head_len, pieces, npieces, digest);
    if (err == 0) {
      digest.finish(static_cast<uint8_t*>(head) + digest_offset);
      std::vector<struct iovec> head_iov{{head, static_cast<size_t>(head_len)}};
      err = writev_all(fd, head_iov, 0);
    }
  } else
#endif
  {
#if KVC_HAVE_XXH3
    if (digest_offset >= 0)  // one window: hashed, then written in one call with its head
      digest_payload(prefix, prefix_len, pieces, npieces, payload_len,
                     static_cast<uint8_t*>(head) + digest_offset);
#endif
    std::vector<struct iovec> iov;
    iov.reserve(static_cast<size_t>(npieces) + 1);
    iov.push_back({head, static_cast<size_t>(head_len)});
    iov.insert(iov.end(), pieces, pieces + npieces);
    err = writev_all(fd, iov);
  }
  if (err == 0 && sync && fdatasync(fd) != 0) err = errno;
  if (close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && rename(temp, path) != 0) err = errno;
  if (err != 0) unlink(temp);
  return err;
}
