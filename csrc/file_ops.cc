// Native file reads: see file_ops.h.
#include "file_ops.h"

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

#ifndef __NR_cachestat
#define __NR_cachestat 451  // Linux 6.5, the same number on every architecture
#endif

namespace {

constexpr int64_t kPage = 4096;
constexpr size_t kIovMax = 1024;  // Linux's IOV_MAX

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

// 1: the page cache holds every page of the file; 0: it does not; -1: cachestat failed (errno).
int page_cache_holds(int fd, int64_t size) {
  CacheStatRange range{0, 0};
  CacheStat stat{};
  if (syscall(__NR_cachestat, fd, &range, &stat, 0) != 0) return -1;
  return static_cast<int64_t>(stat.nr_cache) * kPage >= size ? 1 : 0;
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

// A page-aligned buffer of at least `bytes` for this thread's direct reads of heads (the
// caller's head buffer need not be aligned); nullptr when memory is short.
void* direct_head_buffer(int64_t bytes) {
  struct Buffer {
    void* data = nullptr;
    int64_t size = 0;
    ~Buffer() { free(data); }
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    void* fresh = nullptr;
    if (posix_memalign(&fresh, kPage, static_cast<size_t>(bytes)) != 0) return nullptr;
    free(buffer.data);
    buffer.data = fresh;
    buffer.size = bytes;
  }
  return buffer.data;
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

// Read the file from its start into `iov` (consumed), IOV_MAX entries a call, through short
// reads, up to the end of the file. Returns the bytes read, or -1 with errno set. A read short
// of the end is continued rather than taken for a short file: the kernel copies up to a buffer
// it cannot write (a bad pointer) and the next call reports that error.
int64_t preadv_all(int fd, std::vector<struct iovec>& iov) {
  size_t first = 0;
  int64_t done = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min(kIovMax, iov.size() - first));
    const ssize_t got = preadv(fd, &iov[first], count, done);
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

// Write `iov` (consumed) in order, IOV_MAX entries a call, through short writes. 0 or errno.
int writev_all(int fd, std::vector<struct iovec>& iov) {
  size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min(kIovMax, iov.size() - first));
    const ssize_t put = writev(fd, &iov[first], count);
    if (put < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    first = advance(iov, first, static_cast<size_t>(put));
  }
  return 0;
}

#if KVC_HAVE_XXH3
void digest_payload(const void* prefix, int64_t prefix_len, const struct iovec* pieces,
                    int npieces, int64_t payload_len, uint8_t out[16]) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, prefix, static_cast<size_t>(prefix_len));
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(payload_len >> (8 * i));
  XXH3_128bits_update(&state, length, sizeof(length));
  for (int i = 0; i < npieces; ++i) XXH3_128bits_update(&state, pieces[i].iov_base, pieces[i].iov_len);
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
  memcpy(out, canonical.digest, 16);
}
#endif

}  // namespace

extern "C" int kvc_file_ops_have_digest(void) { return KVC_HAVE_XXH3; }

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
    head_target = direct_head_buffer(head_len);
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
  if (digest_offset >= 0) {
#if KVC_HAVE_XXH3
    if (digest_offset + 16 > head_len) return EINVAL;
    int64_t payload_len = 0;
    for (int i = 0; i < npieces; ++i) payload_len += static_cast<int64_t>(pieces[i].iov_len);
    digest_payload(prefix, prefix_len, pieces, npieces, payload_len,
                   static_cast<uint8_t*>(head) + digest_offset);
#else
    (void)prefix;
    (void)prefix_len;
    return ENOSYS;
#endif
  }
  const int fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return errno;
  std::vector<struct iovec> iov;
  iov.reserve(static_cast<size_t>(npieces) + 1);
  iov.push_back({head, static_cast<size_t>(head_len)});
  iov.insert(iov.end(), pieces, pieces + npieces);
  int err = writev_all(fd, iov);
  if (err == 0 && sync && fdatasync(fd) != 0) err = errno;
  if (close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && rename(temp, path) != 0) err = errno;
  if (err != 0) unlink(temp);
  return err;
}
