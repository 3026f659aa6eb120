// kvcore._fileio: thin CPython binding of file_ops.h; the GIL is released for every read,
// write and batch run.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <vector>

#include "file_ops.h"

namespace {

// Owns the Py_buffers a call holds, released on every way out.
class Buffers {
 public:
  Buffers() = default;
  ~Buffers() {
    for (Py_buffer& view : views_) PyBuffer_Release(&view);
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  void reserve(size_t n) { views_.reserve(n); }

  // A contiguous buffer of `obj` (writable when asked); nullptr with an exception set.
  Py_buffer* acquire(PyObject* obj, bool writable, const char* what) {
    Py_buffer view;
    std::memset(&view, 0, sizeof(view));
    if (PyObject_GetBuffer(obj, &view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
      PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s buffer", what,
                   writable ? " writable" : "");
      return nullptr;
    }
    views_.push_back(view);
    return &views_.back();
  }

  // Every item of `seq` (a PySequence_Fast) as one entry of `iov` (sized to match); false
  // with an exception set when one is not a buffer of the kind asked.
  bool acquire_pieces(PyObject* seq, bool writable, std::vector<struct iovec>& iov) {
    for (size_t i = 0; i < iov.size(); ++i) {
      Py_buffer* piece = acquire(PySequence_Fast_GET_ITEM(seq, static_cast<Py_ssize_t>(i)),
                                 writable, "each piece");
      if (piece == nullptr) return false;
      iov[i] = {piece->buf, static_cast<size_t>(piece->len)};
    }
    return true;
  }

 private:
  std::vector<Py_buffer> views_;
};

PyObject* py_read_file(PyObject*, PyObject* args) {
  PyObject *o_path, *o_head, *o_pieces, *o_prefix;
  int direct;
  if (!PyArg_ParseTuple(args, "O&OOpO", PyUnicode_FSConverter, &o_path, &o_head, &o_pieces,
                        &direct, &o_prefix))
    return nullptr;
  PyObject* path = o_path;  // a new reference to bytes
  PyObject* seq = PySequence_Fast(o_pieces, "pieces must be a sequence of buffers");
  if (seq == nullptr) {
    Py_DECREF(path);
    return nullptr;
  }
  const Py_ssize_t npieces = PySequence_Fast_GET_SIZE(seq);
  Buffers held;
  held.reserve(static_cast<size_t>(npieces) + 2);  // no reallocation: pointers stay valid
  std::vector<struct iovec> iov(static_cast<size_t>(npieces));
  Py_buffer* head = held.acquire(o_head, true, "head");
  Py_buffer* prefix = nullptr;
  bool ok = head != nullptr && held.acquire_pieces(seq, true, iov);
  if (ok && o_prefix != Py_None) {
    prefix = held.acquire(o_prefix, false, "prefix");
    ok = prefix != nullptr;
  }
  if (!ok) {
    Py_DECREF(seq);
    Py_DECREF(path);
    return nullptr;
  }
  uint8_t digest[16] = {0};
  int err_no = 0, used_direct = 0, rc;
  const char* c_path = PyBytes_AS_STRING(path);
  Py_BEGIN_ALLOW_THREADS;
  rc = kvc_read_file(c_path, head->buf, head->len, iov.data(), static_cast<int>(npieces), direct,
                     prefix != nullptr ? prefix->buf : nullptr,
                     prefix != nullptr ? prefix->len : 0, digest, &err_no, &used_direct);
  Py_END_ALLOW_THREADS;
  Py_DECREF(seq);
  Py_DECREF(path);
  if (rc == KVC_READ_OK && prefix != nullptr && kvc_file_ops_have_digest()) {
    return Py_BuildValue("iiOy#", rc, err_no, used_direct ? Py_True : Py_False,
                         reinterpret_cast<const char*>(digest), static_cast<Py_ssize_t>(16));
  }
  return Py_BuildValue("iiOO", rc, err_no, used_direct ? Py_True : Py_False, Py_None);
}

PyObject* py_write_file(PyObject*, PyObject* args) {
  PyObject *o_temp, *o_path, *o_head, *o_pieces, *o_prefix;
  long long digest_offset;
  int sync;
  if (!PyArg_ParseTuple(args, "O&O&OLOOp", PyUnicode_FSConverter, &o_temp, PyUnicode_FSConverter,
                        &o_path, &o_head, &digest_offset, &o_prefix, &o_pieces, &sync))
    return nullptr;
  PyObject* seq = PySequence_Fast(o_pieces, "pieces must be a sequence of buffers");
  if (seq == nullptr) {
    Py_DECREF(o_temp);
    Py_DECREF(o_path);
    return nullptr;
  }
  const Py_ssize_t npieces = PySequence_Fast_GET_SIZE(seq);
  Buffers held;
  held.reserve(static_cast<size_t>(npieces) + 2);
  std::vector<struct iovec> iov(static_cast<size_t>(npieces));
  Py_buffer* head = held.acquire(o_head, true, "head");
  Py_buffer* prefix = nullptr;
  bool ok = head != nullptr && held.acquire_pieces(seq, false, iov);
  if (ok && o_prefix != Py_None) {
    prefix = held.acquire(o_prefix, false, "prefix");
    ok = prefix != nullptr;
  }
  if (ok && digest_offset >= 0 && prefix == nullptr) {
    PyErr_SetString(PyExc_ValueError, "digest_offset needs a prefix (bytes, maybe empty)");
    ok = false;
  }
  if (!ok) {
    Py_DECREF(seq);
    Py_DECREF(o_temp);
    Py_DECREF(o_path);
    return nullptr;
  }
  const char* temp = PyBytes_AS_STRING(o_temp);
  const char* path = PyBytes_AS_STRING(o_path);
  int err;
  Py_BEGIN_ALLOW_THREADS;
  err = kvc_write_file(temp, path, head->buf, head->len, digest_offset,
                       prefix != nullptr ? prefix->buf : nullptr,
                       prefix != nullptr ? prefix->len : 0, iov.data(),
                       static_cast<int>(npieces), sync);
  Py_END_ALLOW_THREADS;
  Py_DECREF(seq);
  Py_DECREF(o_temp);
  Py_DECREF(o_path);
  return PyLong_FromLong(err);
}


// -- batches (file_ops.h: kvc_batch_*) -------------------------------------------------------

// A kvc_file_batch and everything its jobs point into: the encoded paths and prefixes (bytes
// objects, immutable while held), the heads and the pieces' iovecs (held buffers).
struct BatchObject {
  PyObject_HEAD
  kvc_file_batch* batch;
  PyObject* held;  // a tuple: the paths', temps' and prefixes' bytes objects
  Py_buffer heads;
  Py_buffer iov;
  bool has_heads, has_iov;
  Py_ssize_t n;
  int running;  // threads inside run(): results() and dealloc wait for none
};

void batch_dealloc(BatchObject* self) {
  if (self->batch != nullptr) kvc_batch_free(self->batch);
  if (self->has_heads) PyBuffer_Release(&self->heads);
  if (self->has_iov) PyBuffer_Release(&self->iov);
  Py_XDECREF(self->held);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* batch_run(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<BatchObject*>(o);
  kvc_file_batch* batch = self->batch;
  ++self->running;  // under the GIL
  Py_INCREF(o);     // alive while this thread works, whatever the caller drops
  Py_BEGIN_ALLOW_THREADS;
  kvc_batch_run(batch);
  Py_END_ALLOW_THREADS;
  --self->running;
  Py_DECREF(o);
  Py_RETURN_NONE;
}

PyObject* batch_results(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<BatchObject*>(o);
  if (self->running != 0) {
    PyErr_SetString(PyExc_RuntimeError, "results() while run() is still working");
    return nullptr;
  }
  const Py_ssize_t bytes = self->n * static_cast<Py_ssize_t>(sizeof(int32_t));
  PyObject* codes = PyBytes_FromStringAndSize(nullptr, bytes);
  PyObject* err_nos = PyBytes_FromStringAndSize(nullptr, bytes);
  if (codes == nullptr || err_nos == nullptr) {
    Py_XDECREF(codes);
    Py_XDECREF(err_nos);
    return nullptr;
  }
  int64_t direct_reads = 0;
  int refused = 0;
  kvc_batch_results(self->batch, reinterpret_cast<int32_t*>(PyBytes_AS_STRING(codes)),
                    reinterpret_cast<int32_t*>(PyBytes_AS_STRING(err_nos)), &direct_reads,
                    &refused);
  return Py_BuildValue("NNLi", codes, err_nos, static_cast<long long>(direct_reads), refused);
}

PyObject* batch_tails(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<BatchObject*>(o);
  if (self->running != 0) {
    PyErr_SetString(PyExc_RuntimeError, "tails() while run() is still working");
    return nullptr;
  }
  PyObject* tails =
      PyBytes_FromStringAndSize(nullptr, self->n * static_cast<Py_ssize_t>(sizeof(uint64_t)));
  if (tails == nullptr) return nullptr;
  kvc_batch_tails(self->batch, reinterpret_cast<uint64_t*>(PyBytes_AS_STRING(tails)));
  return tails;
}

PyObject* batch_digests(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<BatchObject*>(o);
  if (self->running != 0) {
    PyErr_SetString(PyExc_RuntimeError, "digests() while run() is still working");
    return nullptr;
  }
  PyObject* digests = PyBytes_FromStringAndSize(nullptr, self->n * 16);
  if (digests == nullptr) return nullptr;
  kvc_batch_digests(self->batch, reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(digests)));
  return digests;
}

PyMethodDef kBatchMethods[] = {
    {"run", batch_run, METH_NOARGS,
     "run() -> None: take objects until none is left (the GIL released); call it from as many "
     "threads as should work at once."},
    {"results", batch_results, METH_NOARGS,
     "results() -> (codes, errnos, direct_reads, refused_errno): codes and errnos as int32 "
     "bytes, one per object, once every run() returned."},
    {"digests", batch_digests, METH_NOARGS,
     "digests() -> bytes: digest batches: 16 bytes per object, once every run() returned."},
    {"tails", batch_tails, METH_NOARGS,
     "tails() -> bytes: reads: each object's last 8 head bytes (uint64, 0 unless read whole "
     "and verified), once every run() returned."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject kBatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// An int64 buffer of exactly `count` items; nullptr with an exception set otherwise.
const int64_t* int64_items(Buffers& held, PyObject* obj, Py_ssize_t count, const char* what) {
  Py_buffer* view = held.acquire(obj, false, what);
  if (view == nullptr) return nullptr;
  if (view->len != count * static_cast<Py_ssize_t>(sizeof(int64_t))) {
    PyErr_Format(PyExc_ValueError, "%s must hold %zd int64 values, not %zd bytes", what, count,
                 view->len);
    return nullptr;
  }
  return static_cast<const int64_t*>(view->buf);
}

// Each str of `seq` encoded for the file system (bytes), appended to `out`; false with an
// exception set when one is not a str.
bool encode_paths(PyObject* seq, Py_ssize_t n, PyObject* out, Py_ssize_t at, const char* what) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return false;
  if (PySequence_Fast_GET_SIZE(fast) != n) {
    PyErr_Format(PyExc_ValueError, "%s: %zd items for %zd objects", what,
                 PySequence_Fast_GET_SIZE(fast), n);
    Py_DECREF(fast);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* encoded = nullptr;
    if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &encoded)) {
      Py_DECREF(fast);
      return false;
    }
    PyTuple_SET_ITEM(out, at + i, encoded);
  }
  Py_DECREF(fast);
  return true;
}

PyObject* py_batch(PyObject*, PyObject* args) {
  int kind, direct, sync, stamp_groups = 0;
  PyObject *o_paths, *o_temps, *o_heads, *o_head_offsets, *o_head_lens, *o_prefixes, *o_iov,
      *o_iov_starts, *o_group_starts, *o_mask;
  long long digest_offset;
  double deadline;
  if (!PyArg_ParseTuple(args, "iOOOOOOOOOdLOpp|p", &kind, &o_paths, &o_temps, &o_heads,
                        &o_head_offsets, &o_head_lens, &o_prefixes, &o_iov, &o_iov_starts,
                        &o_group_starts, &deadline, &digest_offset, &o_mask, &direct, &sync,
                        &stamp_groups))
    return nullptr;
  if (kind != KVC_BATCH_READ && kind != KVC_BATCH_WRITE && kind != KVC_BATCH_DIGEST) {
    PyErr_SetString(PyExc_ValueError, "kind must be BATCH_READ, BATCH_WRITE or BATCH_DIGEST");
    return nullptr;
  }
  const Py_ssize_t n = PyObject_Length(o_paths);
  if (n < 0) return nullptr;
  const bool writes = kind == KVC_BATCH_WRITE;
  if (writes && o_temps == Py_None) {
    PyErr_SetString(PyExc_ValueError, "a write batch needs temps");
    return nullptr;
  }
  // held: paths, then temps (writes), then prefixes
  PyObject* held_objects = PyTuple_New(n * (writes ? 3 : 2));
  if (held_objects == nullptr) return nullptr;
  auto* self = PyObject_New(BatchObject, &kBatchType);
  if (self == nullptr) {
    Py_DECREF(held_objects);
    return nullptr;
  }
  self->batch = nullptr;
  self->held = held_objects;  // owned by self from here: every way out is Py_DECREF(self)
  self->has_heads = self->has_iov = false;
  self->n = n;
  self->running = 0;
  PyObject* out = reinterpret_cast<PyObject*>(self);
  if (!encode_paths(o_paths, n, held_objects, 0, "paths") ||
      (writes && !encode_paths(o_temps, n, held_objects, n, "temps"))) {
    Py_DECREF(out);
    return nullptr;
  }
  const Py_ssize_t prefixes_at = writes ? 2 * n : n;
  PyObject* prefixes = PySequence_Fast(o_prefixes, "prefixes must be a sequence of bytes");
  if (prefixes == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  bool ok = PySequence_Fast_GET_SIZE(prefixes) == n;
  if (!ok) PyErr_SetString(PyExc_ValueError, "prefixes: one bytes object per object");
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    PyObject* prefix = PySequence_Fast_GET_ITEM(prefixes, i);
    if (!PyBytes_Check(prefix)) {
      PyErr_SetString(PyExc_TypeError, "each prefix must be bytes");
      ok = false;
      break;
    }
    Py_INCREF(prefix);
    PyTuple_SET_ITEM(held_objects, prefixes_at + i, prefix);
  }
  Py_DECREF(prefixes);
  if (!ok) {  // the tuple's unset items are NULL, which its dealloc skips
    Py_DECREF(out);
    return nullptr;
  }
  Buffers offsets;  // the int64 arrays: read here, not needed once the jobs are built
  const int64_t* head_offsets = int64_items(offsets, o_head_offsets, n + 1, "head_offsets");
  const int64_t* head_lens =
      head_offsets == nullptr ? nullptr : int64_items(offsets, o_head_lens, n, "head_lens");
  const int64_t* iov_starts =
      head_lens == nullptr ? nullptr : int64_items(offsets, o_iov_starts, n + 1, "iov_starts");
  const int64_t* group_starts = nullptr;
  bool groups_ok = iov_starts != nullptr;
  if (groups_ok && o_group_starts != Py_None) {
    group_starts = int64_items(offsets, o_group_starts, n, "group_starts");
    groups_ok = group_starts != nullptr;
  }
  for (Py_ssize_t i = 0; groups_ok && group_starts != nullptr && i < n; ++i) {
    if (group_starts[i] < 0 || group_starts[i] > i) {
      PyErr_Format(PyExc_ValueError, "group_starts[%zd] must be in 0..%zd", i, i);
      groups_ok = false;
    }
  }
  Py_buffer* mask = nullptr;
  if (groups_ok && o_mask != Py_None) mask = offsets.acquire(o_mask, false, "mask");
  if (!groups_ok || (o_mask != Py_None && mask == nullptr) ||
      PyObject_GetBuffer(o_heads, &self->heads, PyBUF_SIMPLE) != 0) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "heads must be a contiguous buffer");
    Py_DECREF(out);
    return nullptr;
  }
  self->has_heads = true;
  if (PyObject_GetBuffer(o_iov, &self->iov, PyBUF_SIMPLE) != 0) {
    PyErr_SetString(PyExc_TypeError, "iov must be a contiguous buffer of int64 pairs");
    Py_DECREF(out);
    return nullptr;
  }
  self->has_iov = true;
  static_assert(sizeof(struct iovec) == 2 * sizeof(int64_t), "an iovec is two int64 values");
  const Py_ssize_t iov_count = self->iov.len / static_cast<Py_ssize_t>(sizeof(struct iovec));
  const auto* iov = static_cast<const struct iovec*>(self->iov.buf);
  const auto* heads = static_cast<const char*>(self->heads.buf);
  std::vector<kvc_file_job> jobs(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t h0 = head_offsets[i], h1 = head_offsets[i + 1];
    const int64_t p0 = iov_starts[i], p1 = iov_starts[i + 1];
    if (h0 < 0 || h1 < h0 || h1 > self->heads.len || p0 < 0 || p1 < p0 || p1 > iov_count ||
        p1 - p0 > INT32_MAX) {
      PyErr_Format(PyExc_ValueError, "object %zd: head_offsets or iov_starts out of range", i);
      Py_DECREF(out);
      return nullptr;
    }
    PyObject* prefix = PyTuple_GET_ITEM(held_objects, prefixes_at + i);
    jobs[i] = kvc_file_job{PyBytes_AS_STRING(PyTuple_GET_ITEM(held_objects, i)),
                           writes ? PyBytes_AS_STRING(PyTuple_GET_ITEM(held_objects, n + i))
                                  : nullptr,
                           heads + h0,
                           h1 - h0,
                           head_lens[i],
                           PyBytes_AS_STRING(prefix),
                           PyBytes_GET_SIZE(prefix),
                           iov + p0,
                           static_cast<int>(p1 - p0)};
  }
  const int64_t deadline_ns =
      deadline >= 9.2e9 ? INT64_MAX : static_cast<int64_t>(deadline * 1e9);
  self->batch = kvc_batch_new(kind, jobs.data(), n, group_starts, deadline_ns, digest_offset,
                              mask != nullptr ? static_cast<const uint8_t*>(mask->buf) : nullptr,
                              mask != nullptr ? mask->len : 0, direct, sync, stamp_groups);
  if (self->batch == nullptr) {
    Py_DECREF(out);
    return PyErr_NoMemory();
  }
  return out;
}

PyMethodDef kMethods[] = {
    {"write_file", py_write_file, METH_VARARGS,
     "write_file(temp, path, head, digest_offset, prefix, pieces, sync) -> errno (0: written)\n\n"
     "Write head and pieces to a new temp file, sync it if asked, rename it over path. The GIL "
     "is released for the call. See kvcore.fileio."},
    {"read_file", py_read_file, METH_VARARGS,
     "read_file(path, head, pieces, direct, prefix) -> (code, errno, used_direct, digest)\n\n"
     "Read a whole file: its first len(head) bytes into head, the rest into pieces in order. "
     "The GIL is released for the call. See kvcore.fileio."},
    {"batch", py_batch, METH_VARARGS,
     "batch(kind, paths, temps, heads, head_offsets, head_lens, prefixes, iov, iov_starts, "
     "group_starts, deadline, digest_offset, mask, direct, sync[, stamp_groups]) -> Batch\n\n"
     "Many objects' reads or writes, run by Batch.run() from any number of threads. See "
     "kvcore.fileio."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kvcore._fileio",
                       "Native file reads (csrc/file_ops.h); use kvcore.fileio.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__fileio(void) {
  kBatchType.tp_name = "kvcore._fileio.Batch";
  kBatchType.tp_basicsize = sizeof(BatchObject);
  kBatchType.tp_flags = Py_TPFLAGS_DEFAULT;
  kBatchType.tp_doc = "A batch of file reads or writes (see kvcore.fileio.FileBatch).";
  kBatchType.tp_dealloc = reinterpret_cast<destructor>(batch_dealloc);
  kBatchType.tp_methods = kBatchMethods;
  if (PyType_Ready(&kBatchType) != 0) return nullptr;
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  if (PyModule_AddIntConstant(module, "HAVE_DIGEST", kvc_file_ops_have_digest()) != 0 ||
      PyModule_AddStringConstant(module, "DIGEST_KERNEL", kvc_file_ops_digest_kernel()) != 0 ||
      PyModule_AddIntConstant(module, "OK", KVC_READ_OK) != 0 ||
      PyModule_AddIntConstant(module, "MISSING", KVC_READ_MISSING) != 0 ||
      PyModule_AddIntConstant(module, "OTHER", KVC_READ_OTHER) != 0 ||
      PyModule_AddIntConstant(module, "ERRNO", KVC_READ_ERRNO) != 0 ||
      PyModule_AddIntConstant(module, "DIRECT_REFUSED", KVC_READ_DIRECT_REFUSED) != 0 ||
      PyModule_AddIntConstant(module, "DEADLINE", KVC_BATCH_DEADLINE) != 0 ||
      PyModule_AddIntConstant(module, "SKIPPED", KVC_BATCH_SKIPPED) != 0 ||
      PyModule_AddIntConstant(module, "MISMATCH", KVC_BATCH_MISMATCH) != 0 ||
      PyModule_AddIntConstant(module, "BATCH_READ", KVC_BATCH_READ) != 0 ||
      PyModule_AddIntConstant(module, "BATCH_WRITE", KVC_BATCH_WRITE) != 0 ||
      PyModule_AddIntConstant(module, "BATCH_DIGEST", KVC_BATCH_DIGEST) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
