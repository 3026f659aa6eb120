// A page-aligned buffer of each thread's own, grown on demand and kept for the thread's life:
// room for a file's head where direct I/O needs alignment, with no allocation per file.
#ifndef KVCORE_THREAD_BUFFER_H_
#define KVCORE_THREAD_BUFFER_H_

#include <stdint.h>
#include <stdlib.h>

namespace kvc {

constexpr int64_t kBufferAlign = 4096;

// At least `bytes` (a page at least), aligned to a page; nullptr when memory is short. Each
// `Tag` is a buffer of its own: code that holds one while calling code that uses another
// gives each its tag.
template <int Tag>
void* thread_page_buffer(int64_t bytes) {
  struct Buffer {
    void* data = nullptr;
    int64_t size = 0;
    ~Buffer() { free(data); }
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    const int64_t size = bytes > kBufferAlign ? bytes : kBufferAlign;
    void* fresh = nullptr;
    if (posix_memalign(&fresh, kBufferAlign, static_cast<size_t>(size)) != 0) return nullptr;
    free(buffer.data);
    buffer.data = fresh;
    buffer.size = size;
  }
  return buffer.data;
}

// The tags of kvcore's buffers.
enum BufferTag { kDirectHead = 0, kBatchHead = 1 };

}  // namespace kvc

#endif  // KVCORE_THREAD_BUFFER_H_
