// Batches of whole-file reads and writes: see file_ops.h.
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <vector>

#include "file_ops.h"
#include "thread_buffer.h"

namespace {

int64_t monotonic_ns() {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

}  // namespace

struct kvc_file_batch {
  int kind;
  std::vector<kvc_file_job> jobs;
  std::vector<int64_t> group_starts;  // empty: every object a group of its own
  int64_t deadline_ns;
  int64_t digest_offset;
  std::vector<uint8_t> mask;
  int sync;
  std::atomic<int> direct;
  std::atomic<int> refused_errno{0};
  std::atomic<int64_t> next{0};
  // objects from here on are not started: their group, or an earlier one, failed
  std::atomic<int64_t> stop;
  std::atomic<int64_t> direct_reads{0};
  std::vector<int32_t> codes;
  std::vector<int32_t> err_nos;

  void failed_at(int64_t k) {
    const int64_t first_of_group = group_starts.empty() ? k : group_starts[static_cast<size_t>(k)];
    int64_t seen = stop.load(std::memory_order_relaxed);
    while (first_of_group < seen &&
           !stop.compare_exchange_weak(seen, first_of_group, std::memory_order_relaxed)) {
    }
  }

  // Whether the file's head (`found`) is what the job expects under the mask.
  bool head_matches(const kvc_file_job& job, const uint8_t* found) const {
    const auto* want = static_cast<const uint8_t*>(job.head);
    const int64_t masked = std::min<int64_t>(job.head_used, static_cast<int64_t>(mask.size()));
    for (int64_t i = 0; i < masked; ++i) {
      if (mask[static_cast<size_t>(i)] != 0 && want[i] != found[i]) return false;
    }
    return memcmp(want + masked, found + masked, static_cast<size_t>(job.head_used - masked)) ==
           0;
  }

  int read(const kvc_file_job& job, int* err_no) {
    auto* head = static_cast<uint8_t*>(kvc::thread_page_buffer<kvc::kBatchHead>(job.head_len));
    if (head == nullptr) {
      *err_no = ENOMEM;
      return KVC_READ_ERRNO;
    }
    const bool check_digest = digest_offset >= 0 && kvc_file_ops_have_digest();
    uint8_t digest[16];
    int used_direct = 0;
    int rc = kvc_read_file(job.path, head, job.head_len, job.pieces, job.npieces,
                           direct.load(std::memory_order_relaxed), check_digest ? job.prefix : nullptr,
                           job.prefix_len, digest, err_no, &used_direct);
    if (rc == KVC_READ_DIRECT_REFUSED) {  // found on first use: the rest reads buffered
      int none = 0;
      refused_errno.compare_exchange_strong(none, *err_no);
      direct.store(0, std::memory_order_relaxed);
      rc = kvc_read_file(job.path, head, job.head_len, job.pieces, job.npieces, 0,
                         check_digest ? job.prefix : nullptr, job.prefix_len, digest, err_no,
                         &used_direct);
    }
    if (rc != KVC_READ_OK) return rc;
    if (used_direct) direct_reads.fetch_add(1, std::memory_order_relaxed);
    if (job.head_used > job.head_len || !head_matches(job, head)) return KVC_BATCH_MISMATCH;
    if (check_digest && memcmp(head + digest_offset, digest, 16) != 0) return KVC_BATCH_MISMATCH;
    return KVC_READ_OK;
  }

  int write(const kvc_file_job& job, int* err_no) {
    auto* head = static_cast<uint8_t*>(kvc::thread_page_buffer<kvc::kBatchHead>(job.head_len));
    if (head == nullptr || job.head_used > job.head_len) {
      *err_no = head == nullptr ? ENOMEM : EINVAL;
      return KVC_READ_ERRNO;
    }
    memcpy(head, job.head, static_cast<size_t>(job.head_used));
    memset(head + job.head_used, 0, static_cast<size_t>(job.head_len - job.head_used));
    *err_no = kvc_write_file(job.temp, job.path, head, job.head_len, digest_offset, job.prefix,
                             job.prefix_len, job.pieces, job.npieces, sync);
    return *err_no == 0 ? KVC_READ_OK : KVC_READ_ERRNO;
  }

  void run() {
    const int64_t n = static_cast<int64_t>(jobs.size());
    for (;;) {
      const int64_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= n) return;
      if (k >= stop.load(std::memory_order_relaxed)) {
        codes[k] = KVC_BATCH_SKIPPED;
        continue;  // the rest are marked too, by whoever takes them
      }
      if (monotonic_ns() >= deadline_ns) {
        codes[k] = KVC_BATCH_DEADLINE;
        failed_at(k);
        continue;
      }
      int err_no = 0;
      const int rc = kind == KVC_BATCH_READ ? read(jobs[k], &err_no) : write(jobs[k], &err_no);
      codes[k] = rc;
      err_nos[k] = err_no;
      // a file to look at again may still turn out to be the object: only failures stop
      if (rc != KVC_READ_OK && rc != KVC_READ_OTHER && rc != KVC_BATCH_MISMATCH) failed_at(k);
    }
  }
};

extern "C" kvc_file_batch* kvc_batch_new(int kind, const struct kvc_file_job* jobs, int64_t n,
                                         const int64_t* group_starts, int64_t deadline_ns,
                                         int64_t digest_offset, const uint8_t* mask,
                                         int64_t mask_len, int direct, int sync) {
  kvc_file_batch* batch = new (std::nothrow) kvc_file_batch();
  if (batch == nullptr) return nullptr;
  try {
    batch->kind = kind;
    batch->jobs.assign(jobs, jobs + n);
    if (group_starts != nullptr) batch->group_starts.assign(group_starts, group_starts + n);
    batch->deadline_ns = deadline_ns;
    batch->digest_offset = digest_offset;
    if (mask != nullptr && mask_len > 0) batch->mask.assign(mask, mask + mask_len);
    batch->sync = sync;
    batch->direct.store(direct);
    batch->stop.store(n);
    batch->codes.assign(static_cast<size_t>(n), KVC_BATCH_SKIPPED);
    batch->err_nos.assign(static_cast<size_t>(n), 0);
  } catch (const std::bad_alloc&) {
    delete batch;
    return nullptr;
  }
  return batch;
}

extern "C" void kvc_batch_run(kvc_file_batch* batch) { batch->run(); }

extern "C" void kvc_batch_results(const kvc_file_batch* batch, int32_t* codes, int32_t* err_nos,
                                  int64_t* direct_reads, int* refused_errno) {
  std::copy(batch->codes.begin(), batch->codes.end(), codes);
  std::copy(batch->err_nos.begin(), batch->err_nos.end(), err_nos);
  *direct_reads = batch->direct_reads.load();
  *refused_errno = batch->refused_errno.load();
}

extern "C" void kvc_batch_free(kvc_file_batch* batch) { delete batch; }
