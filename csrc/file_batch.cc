// Batches of whole-file reads and writes: see file_ops.h.
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <memory>
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
  std::vector<uint64_t> tails;  // reads: each head's last 8 bytes (0 unless read whole)
  std::vector<uint8_t> digests;  // digest batches, stamped writes: 16 bytes per object
  // stamped writes (see kvc_batch_new): each object's open temp file until its group is
  // finished; per group (at its first object's index) its objects not yet done and the first
  // errno of one that failed
  bool stamped = false;
  std::vector<int> fds;
  std::vector<int64_t> group_ends;
  std::unique_ptr<std::atomic<int64_t>[]> group_left;
  std::unique_ptr<std::atomic<int>[]> group_err;

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

  int read(const kvc_file_job& job, int* err_no, uint64_t* tail) {
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
    if (job.head_len >= 8) memcpy(tail, head + job.head_len - 8, 8);
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

  int64_t group_of(int64_t k) const {
    return group_starts.empty() ? k : group_starts[static_cast<size_t>(k)];
  }

  // Stamped writes: object k is done (its payload written, or err: failed, not started); the
  // one that completes its group finishes the group.
  void member_done(int64_t k, int err) {
    const int64_t g = group_of(k);
    if (err != 0) {
      int none = 0;
      group_err[g].compare_exchange_strong(none, err, std::memory_order_acq_rel);
    }
    if (group_left[g].fetch_sub(1, std::memory_order_acq_rel) == 1) finish_group(g);
  }

  void finish_group(int64_t g) {
    const int64_t end = group_ends[static_cast<size_t>(g)];
    if (group_err[g].load(std::memory_order_acquire) != 0) {
      for (int64_t k = g; k < end; ++k) {
        if (fds[k] < 0) continue;
        kvc_abandon_write(fds[k], jobs[k].temp);
        fds[k] = -1;
        codes[k] = KVC_READ_ERRNO;
        err_nos[k] = ECANCELED;
      }
      return;
    }
    uint64_t stamp = kvc_stamp(&digests[static_cast<size_t>(g) * 16],
                               static_cast<size_t>(end - g) * 16);
    uint8_t stamp_bytes[8];
    for (int i = 0; i < 8; ++i) stamp_bytes[i] = static_cast<uint8_t>(stamp >> (8 * i));
    bool failed = false;
    for (int64_t k = g; k < end; ++k) {
      const kvc_file_job& job = jobs[k];
      if (failed) {  // the group is not stored whole: the rest is not renamed
        kvc_abandon_write(fds[k], job.temp);
        fds[k] = -1;
        codes[k] = KVC_READ_ERRNO;
        err_nos[k] = ECANCELED;
        continue;
      }
      auto* head = static_cast<uint8_t*>(kvc::thread_page_buffer<kvc::kBatchHead>(job.head_len));
      int err = head == nullptr ? ENOMEM : 0;
      if (err == 0) {
        memcpy(head, job.head, static_cast<size_t>(job.head_used));
        memset(head + job.head_used, 0, static_cast<size_t>(job.head_len - job.head_used));
        memcpy(head + digest_offset, &digests[static_cast<size_t>(k) * 16], 16);
        memcpy(head + job.head_len - 8, stamp_bytes, 8);
        err = kvc_finish_write(fds[k], job.temp, job.path, head, job.head_len, sync);
      } else {
        kvc_abandon_write(fds[k], job.temp);
      }
      fds[k] = -1;
      codes[k] = err == 0 ? KVC_READ_OK : KVC_READ_ERRNO;
      err_nos[k] = err;
      if (err != 0) {
        failed = true;
        failed_at(k);
      }
    }
  }

  // Stamped writes: object k's payload, hashed; its code is set when its group is finished.
  void write_member(int64_t k) {
    const kvc_file_job& job = jobs[k];
    int err = job.head_used > job.head_len || job.head_len < 8 ? EINVAL : 0;
    if (err == 0) {
      err = kvc_write_payload(job.temp, job.head_len, job.prefix, job.prefix_len, job.pieces,
                              job.npieces, &digests[static_cast<size_t>(k) * 16], &fds[k]);
    }
    if (err != 0) {
      codes[k] = KVC_READ_ERRNO;
      err_nos[k] = err;
      failed_at(k);
    }
    member_done(k, err);
  }

  void run() {
    const int64_t n = static_cast<int64_t>(jobs.size());
    for (;;) {
      const int64_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= n) return;
      if (k >= stop.load(std::memory_order_relaxed)) {
        codes[k] = KVC_BATCH_SKIPPED;
        if (stamped) member_done(k, ECANCELED);
        continue;  // the rest are marked too, by whoever takes them
      }
      if (monotonic_ns() >= deadline_ns) {
        codes[k] = KVC_BATCH_DEADLINE;
        failed_at(k);
        if (stamped) member_done(k, ETIMEDOUT);
        continue;
      }
      if (stamped) {
        write_member(k);
        continue;
      }
      int err_no = 0;
      int rc;
      if (kind == KVC_BATCH_DIGEST) {
        const kvc_file_job& job = jobs[k];
        err_no = kvc_digest_pieces(job.prefix, job.prefix_len, job.pieces, job.npieces,
                                   &digests[static_cast<size_t>(k) * 16]);
        rc = err_no == 0 ? KVC_READ_OK : KVC_READ_ERRNO;
      } else {
        rc = kind == KVC_BATCH_READ ? read(jobs[k], &err_no, &tails[k]) : write(jobs[k], &err_no);
      }
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
                                         int64_t mask_len, int direct, int sync,
                                         int stamp_groups) {
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
    batch->tails.assign(static_cast<size_t>(n), 0);
    batch->stamped = kind == KVC_BATCH_WRITE && stamp_groups != 0 && digest_offset >= 0 &&
                     group_starts != nullptr;
    if (kind == KVC_BATCH_DIGEST || batch->stamped)
      batch->digests.assign(static_cast<size_t>(n) * 16, 0);
    if (batch->stamped) {
      batch->fds.assign(static_cast<size_t>(n), -1);
      batch->group_ends.assign(static_cast<size_t>(n), 0);
      batch->group_left.reset(new std::atomic<int64_t>[static_cast<size_t>(n)]);
      batch->group_err.reset(new std::atomic<int>[static_cast<size_t>(n)]);
      for (int64_t k = 0; k < n; ++k) {
        batch->group_left[k].store(0);
        batch->group_err[k].store(0);
      }
      for (int64_t k = 0; k < n; ++k) {
        const int64_t g = group_starts[k];
        batch->group_left[g].fetch_add(1);
        batch->group_ends[static_cast<size_t>(g)] = k + 1;
      }
    }
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

extern "C" void kvc_batch_tails(const kvc_file_batch* batch, uint64_t* tails) {
  std::copy(batch->tails.begin(), batch->tails.end(), tails);
}

extern "C" void kvc_batch_digests(const kvc_file_batch* batch, uint8_t* digests) {
  std::copy(batch->digests.begin(), batch->digests.end(), digests);
}

extern "C" void kvc_batch_free(kvc_file_batch* batch) { delete batch; }
