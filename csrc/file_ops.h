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
// Which xxh3 kernel computes digests: "avx512" or "avx2" where the CPU has it (and the build
// could make it), else "baseline" (the build's target: SSE2 on x86-64); "none" without
// digests.
const char* kvc_file_ops_digest_kernel(void);

// Read the file at `path` (opened O_NOFOLLOW and non-blocking: a FIFO never waits): its first
// `head_len` bytes into `head`, the rest into `pieces` in order. The file must be a regular file
// of exactly head_len + the pieces' total bytes.
//
// `direct` != 0: when the page cache lacks the file's first or last page (cachestat(2), which
// does no I/O) and head_len and every piece's address and length are multiples of 4096, the read goes
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


// -- batches ---------------------------------------------------------------------------------
//
// A batch runs many objects' reads or writes (each one kvc_read_file / kvc_write_file) from
// any number of the caller's threads at once: each thread that calls kvc_batch_run takes the
// next object from a shared counter until none is left, with no lock and no GIL. Objects come
// in groups (a block's parts): once one object fails, objects of later groups are skipped
// (they could not count), and past the deadline nothing more starts. It knows nothing of any
// backend's file format: the caller gives each object's head bytes (what to write, or what a
// read must find under `mask`) and where in the head the digest sits.

// One object of a batch. Pointers stay the caller's, valid until kvc_batch_free.
struct kvc_file_job {
  const char* path;
  const char* temp;  // writes: the temp file written, then renamed over path
  // writes: the head's first head_used bytes (zeros follow up to head_len);
  // reads: what the file's first head_used bytes must be (see kvc_batch_new's mask)
  const void* head;
  int64_t head_used;
  int64_t head_len;                // bytes before the payload in the file
  const void* prefix;              // digest prefix (see kvc_read_file)
  int64_t prefix_len;
  const struct iovec* pieces;      // the payload, in order
  int npieces;
};

// An object's result in a batch: KVC_READ_* codes (writes: OK or ERRNO), or one of these.
enum {
  KVC_BATCH_DEADLINE = 5,  // not started: the deadline had passed
  KVC_BATCH_SKIPPED = 6,   // not started: an object of an earlier group failed
  // reads: the file is there and whole but is not what the job expected (its head differs
  // under the mask, or its digest does not match): the caller's own code looks at it
  KVC_BATCH_MISMATCH = 7
};
// KVC_BATCH_DIGEST: no file; each object's digest of its prefix and pieces, as reads and writes
// compute it (kvc_digest_pieces), for kvc_batch_digests.
enum { KVC_BATCH_READ = 0, KVC_BATCH_WRITE = 1, KVC_BATCH_DIGEST = 2 };

typedef struct kvc_file_batch kvc_file_batch;

// A batch of `n` jobs (copied; what they point at is not). `group_starts` (n items, or NULL:
// every object a group of its own): the index of the first object of object k's group; the
// objects of a group are consecutive.
// `deadline_ns`: CLOCK_MONOTONIC nanoseconds, INT64_MAX for none. `digest_offset` >= 0: reads
// check, writes fill the digest at head[digest_offset .. +16] (needs
// kvc_file_ops_have_digest()). Reads: byte i < head_used of the file's head must equal the
// job's head[i] unless i < mask_len and mask[i] == 0; `direct` as in kvc_read_file (refused
// once, the batch reads the rest buffered). Writes: `sync` as in kvc_write_file;
// `stamp_groups` (with a digest_offset and group_starts): each group's objects are written
// together, the last 8 bytes of each head its group's write stamp (kvc_stamp of the group's
// digests in order, little-endian): every payload is written and hashed first
// (kvc_write_payload), and whoever finishes a group's last one finishes them all
// (kvc_finish_write); an object of a group where one failed or was not started is abandoned
// (ECANCELED). NULL when memory is short.
kvc_file_batch* kvc_batch_new(int kind, const struct kvc_file_job* jobs, int64_t n,
                              const int64_t* group_starts,
                              int64_t deadline_ns, int64_t digest_offset, const uint8_t* mask,
                              int64_t mask_len, int direct, int sync, int stamp_groups);
// Take objects until none is left (call it from as many threads as should work at once).
void kvc_batch_run(kvc_file_batch* batch);
// After every kvc_batch_run returned: each object's code and errno (n each), and how many
// reads went around the page cache; *refused_errno: the errno with which O_DIRECT or
// cachestat(2) was refused (0: never).
void kvc_batch_results(const kvc_file_batch* batch, int32_t* codes, int32_t* err_nos,
                       int64_t* direct_reads, int* refused_errno);
// A write in two steps, for objects whose heads need something of their siblings (a block's
// write stamp, made of every part's digest): kvc_write_payload creates `temp` (0600,
// exclusively) and writes the payload at `head_len`, hashing it as it goes (the digest
// kvc_read_file computes, into `digest`), and leaves it open (*fd_out); kvc_finish_write
// writes `head` at the start, fdatasyncs when `sync`, closes and renames `temp` over `path`;
// kvc_abandon_write closes and removes it. 0 or errno; on an error, `temp` is gone.
int kvc_write_payload(const char* temp, int64_t head_len, const void* prefix, int64_t prefix_len,
                      const struct iovec* pieces, int npieces, uint8_t digest[16], int* fd_out);
int kvc_finish_write(int fd, const char* temp, const char* path, const void* head,
                     int64_t head_len, int sync);
void kvc_abandon_write(int fd, const char* temp);
// XXH3-64 of `data` (0 when built without xxhash.h): a block's write stamp, of its parts'
// digests in order.
uint64_t kvc_stamp(const void* data, size_t len);
// The digest kvc_read_file computes (xxh3-128 of prefix, payload length, payload) of the
// payload `pieces` in memory, into out. 0, or ENOSYS when built without xxhash.h.
int kvc_digest_pieces(const void* prefix, int64_t prefix_len, const struct iovec* pieces,
                      int npieces, uint8_t out[16]);
// After every kvc_batch_run of a KVC_BATCH_DIGEST batch returned: 16 bytes per object.
void kvc_batch_digests(const kvc_file_batch* batch, uint8_t* digests);
// After every kvc_batch_run returned, reads: the last 8 bytes of each object's head as read
// (n items; 0 for an object not read whole and verified). A caller keeps a small stamp there.
void kvc_batch_tails(const kvc_file_batch* batch, uint64_t* tails);
void kvc_batch_free(kvc_file_batch* batch);

#ifdef __cplusplus
}
#endif

#endif  // KVCORE_FILE_OPS_H_
