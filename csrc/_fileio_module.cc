// kvcore._fileio: thin CPython binding of file_ops.h; the GIL is released for the whole read.
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

PyMethodDef kMethods[] = {
    {"write_file", py_write_file, METH_VARARGS,
     "write_file(temp, path, head, digest_offset, prefix, pieces, sync) -> errno (0: written)\n\n"
     "Write head and pieces to a new temp file, sync it if asked, rename it over path. The GIL "
     "is released for the call. See kvcore.fileio."},
    {"read_file", py_read_file, METH_VARARGS,
     "read_file(path, head, pieces, direct, prefix) -> (code, errno, used_direct, digest)\n\n"
     "Read a whole file: its first len(head) bytes into head, the rest into pieces in order. "
     "The GIL is released for the call. See kvcore.fileio."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kvcore._fileio",
                       "Native file reads (csrc/file_ops.h); use kvcore.fileio.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__fileio(void) {
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  if (PyModule_AddIntConstant(module, "HAVE_DIGEST", kvc_file_ops_have_digest()) != 0 ||
      PyModule_AddIntConstant(module, "OK", KVC_READ_OK) != 0 ||
      PyModule_AddIntConstant(module, "MISSING", KVC_READ_MISSING) != 0 ||
      PyModule_AddIntConstant(module, "OTHER", KVC_READ_OTHER) != 0 ||
      PyModule_AddIntConstant(module, "ERRNO", KVC_READ_ERRNO) != 0 ||
      PyModule_AddIntConstant(module, "DIRECT_REFUSED", KVC_READ_DIRECT_REFUSED) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
