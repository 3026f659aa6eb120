// kvcore._swap: thin CPython binding of swap_ops.h. Arrays arrive as 1-D buffers of 8-byte
// integers (numpy int64/uint64); the GIL is released while copying.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>

#include "swap_ops.h"

namespace {

// Owns one Py_buffer of 8-byte integers for the duration of a call.
class IntBuffer {
 public:
  IntBuffer() { std::memset(&view_, 0, sizeof(view_)); }
  ~IntBuffer() {
    if (view_.obj != nullptr) PyBuffer_Release(&view_);
  }
  IntBuffer(const IntBuffer&) = delete;
  IntBuffer& operator=(const IntBuffer&) = delete;

  bool acquire(PyObject* obj, const char* name) {
    if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
    const char* fmt = view_.format != nullptr ? view_.format : "B";
    const char code = fmt[std::strlen(fmt) - 1];
    const bool int8 = view_.itemsize == 8 && std::strchr("qQlL", code) != nullptr;
    if (!int8 || view_.ndim > 1) {
      PyErr_Format(PyExc_TypeError, "%s must be a 1-D buffer of 8-byte integers", name);
      return false;
    }
    return true;
  }
  Py_ssize_t size() const { return view_.len / 8; }
  template <typename T>
  const T* data() const {
    return static_cast<const T*>(view_.buf);
  }

 private:
  Py_buffer view_;
};

PyObject* raise_status(int rc, const char* msg) {
  PyErr_SetString(rc == KVC_EINVAL ? PyExc_ValueError : PyExc_RuntimeError, msg);
  return nullptr;
}

PyObject* py_swap_all_layers(PyObject*, PyObject* args) {
  PyObject *o_dev, *o_host, *o_nblk, *o_dids, *o_hids;
  long long block_bytes, host_nblocks;
  int mode, nthreads;
  if (!PyArg_ParseTuple(args, "OOOLLOOii", &o_dev, &o_host, &o_nblk, &block_bytes, &host_nblocks,
                        &o_dids, &o_hids, &mode, &nthreads))
    return nullptr;
  IntBuffer dev, host, nblk, dids, hids;
  if (!dev.acquire(o_dev, "dev_ptrs") || !host.acquire(o_host, "host_ptrs") ||
      !nblk.acquire(o_nblk, "dev_nblocks") || !dids.acquire(o_dids, "device_block_ids") ||
      !hids.acquire(o_hids, "host_block_ids"))
    return nullptr;
  if (dev.size() != host.size() || dev.size() != nblk.size())
    return raise_status(KVC_EINVAL, "dev_ptrs, host_ptrs and dev_nblocks differ in length");
  if (dids.size() != hids.size())
    return raise_status(KVC_EINVAL, "device_block_ids and host_block_ids differ in length");
  char err[512] = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS;
  rc = kvc_swap_all_layers(dev.data<uintptr_t>(), host.data<uintptr_t>(), nblk.data<int64_t>(),
                           static_cast<int>(dev.size()), block_bytes, host_nblocks,
                           dids.data<int64_t>(), hids.data<int64_t>(), dids.size(), mode,
                           nthreads, err, sizeof(err));
  Py_END_ALLOW_THREADS;
  if (rc != KVC_OK) return raise_status(rc, err);
  Py_RETURN_NONE;
}

PyObject* py_swap_layout(PyObject*, PyObject* args) {
  PyObject *o_ptrs, *o_nblk, *o_dids, *o_sids;
  long long block_bytes, nslots;
  unsigned long long staging;
  int mode, nthreads;
  if (!PyArg_ParseTuple(args, "OOLKLOOii", &o_ptrs, &o_nblk, &block_bytes, &staging, &nslots,
                        &o_dids, &o_sids, &mode, &nthreads))
    return nullptr;
  IntBuffer ptrs, nblk, dids, sids;
  if (!ptrs.acquire(o_ptrs, "layer_ptrs") || !nblk.acquire(o_nblk, "layer_nblocks") ||
      !dids.acquire(o_dids, "device_block_ids") || !sids.acquire(o_sids, "staging_slot_ids"))
    return nullptr;
  if (ptrs.size() != nblk.size())
    return raise_status(KVC_EINVAL, "layer_ptrs and layer_nblocks differ in length");
  if (dids.size() != sids.size())
    return raise_status(KVC_EINVAL, "device_block_ids and staging_slot_ids differ in length");
  char err[512] = {0};
  int rc;
  Py_BEGIN_ALLOW_THREADS;
  rc = kvc_swap_layout(ptrs.data<uintptr_t>(), nblk.data<int64_t>(), static_cast<int>(ptrs.size()),
                       block_bytes, static_cast<uintptr_t>(staging), nslots, dids.data<int64_t>(),
                       sids.data<int64_t>(), dids.size(), mode, nthreads, err, sizeof(err));
  Py_END_ALLOW_THREADS;
  if (rc != KVC_OK) return raise_status(rc, err);
  Py_RETURN_NONE;
}

PyObject* py_resolve_threads(PyObject*, PyObject* args) {
  int requested;
  long long total;
  if (!PyArg_ParseTuple(args, "iL", &requested, &total)) return nullptr;
  return PyLong_FromLong(kvc_resolve_threads(requested, total));
}

PyMethodDef kMethods[] = {
    {"swap_all_layers", py_swap_all_layers, METH_VARARGS,
     "swap_all_layers(dev_ptrs, host_ptrs, dev_nblocks, block_bytes, host_nblocks, dev_ids, "
     "host_ids, mode, nthreads)"},
    {"swap_layout", py_swap_layout, METH_VARARGS,
     "swap_layout(layer_ptrs, layer_nblocks, block_bytes, staging, staging_nslots, dev_ids, "
     "slot_ids, mode, nthreads); staging_nslots < 0 means unknown"},
    {"resolve_threads", py_resolve_threads, METH_VARARGS,
     "resolve_threads(requested, total_bytes) -> threads used for such a copy"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_swap", "Native KV-cache swap ops (CPU).", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__swap(void) { return PyModule_Create(&kModule); }
