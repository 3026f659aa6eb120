// C ABI of kvcore's native file reads (used by kvcore._fileio).
//
// One call reads one whole file into the caller's memory: a head buffer for its first bytes and
// the payload straight into the caller's pieces (an engine's cache block, one piece per layer),
// with one vectored system call where the kernel allows, then hashes the payload. It knows
// nothing of any backend's file format: the caller checks the head and the digest. Nothing here
// takes Python's GIL, so a binding can release it for the whole call.
#ifndef KVCORE_FILE_OPS_H_
#define KVCORE_FILE_OPS_H_

#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

// What kvc_read_file found.
enum {
  KVC_READ_OK = 0,       // head and pieces filled (and the digest computed, when asked)
  KVC_READ_MISSING = 1,  // no file at the path
  KVC_READ_OTHER = 2,    // something else is there (not a regular file, another size, a read
                         // ending early, a symlink): the caller's own path looks at it
  KVC_READ_ERRNO = 3,    // a system call failed: *err_no says which error (e.g. EFAULT)
  KVC_READ_DIRECT_REFUSED = 4  // O_DIRECT or cachestat(2) refused (*err_no): nothing was
                               // decided about the file; read it again without `direct`
};

// Whether this build computes digests (xxh3-128; 0 when xxhash.h was missing at build time).
int kvc_file_ops_have_digest(void);

// Read the file at `path` (opened O_NOFOLLOW and non-blocking: a FIFO never waits): its first
// `head_len` bytes into `head`, the rest into `pieces` in order. The file must be a regular file
// of exactly head_len + the pieces' total bytes.
//
// `direct` != 0: when the page cache does not hold the whole file (cachestat(2), which does no
// I/O) and head_len and every piece's address and length are multiples of 4096, the read goes
// around the page cache (O_DIRECT); *used_direct says whether it did.
//
// `prefix` != NULL: digest_out receives the canonical (big-endian) xxh3-128 of `prefix`, then
// the payload's length as a little-endian u64, then the payload.
int kvc_read_file(const char* path, void* head, int64_t head_len, const struct iovec* pieces,
                  int npieces, int direct, const void* prefix, int64_t prefix_len,
                  uint8_t digest_out[16], int* err_no, int* used_direct);

// Write a file whole, then give it its name: create `temp` (0600, exclusively, O_NOFOLLOW),
// write `head` then `pieces` in order (vectored, through short writes), fdatasync it when
// `sync`, close it and rename it over `path`. Readers see the old file or the new one, never a
// partial one. `digest_offset` >= 0: first put the digest of `prefix` and the pieces (as
// kvc_read_file computes it) into head[digest_offset .. +16] (the caller's head is changed);
// this needs kvc_file_ops_have_digest(). Returns 0, or the errno of the call that failed (the
// temp file is then removed).
int kvc_write_file(const char* temp, const char* path, void* head, int64_t head_len,
                   int64_t digest_offset, const void* prefix, int64_t prefix_len,
                   const struct iovec* pieces, int npieces, int sync);

#ifdef __cplusplus
}
#endif

#endif  // KVCORE_FILE_OPS_H_
