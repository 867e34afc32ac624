// memlab's saved-tensor hooks written in C (memlab/core/native/pack.py builds and loads this).
//
// A breakdown tags each tensor autograd saves: PyTorch calls the pack hook with the tensor's
// Python object, once per saved tensor, and the unpack hook once per use in backward. Written
// in Python, or as a call of memlab's op (memlab::saved) through its Python binding, each call
// costs a frame and an argument parse; these are two C functions. The pack hook hands the tensor
// to the record's kernel (`mn_save_into` in record.cpp, which logs the saving and returns an
// alias that logs its end) and wraps the alias; the unpack hook returns what it is given.
//
// Built apart from record.cpp because it needs Python's headers and PyTorch's Python layer
// (its Tensor objects); where it cannot be built, memlab calls the op as before.
//
// Also here, as it needs Python's headers too: the notebook namespace's scan at each tracked
// cell (memlab/magic/namespace.py), one pass over the dict in C where numpy took three.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <new>
#include <utility>
#include <vector>

namespace {

using SaveFn = int (*)(const at::Tensor*, at::Tensor*);
SaveFn save_into = nullptr;

PyObject* pack(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "memlab's pack hook takes a tensor, got %s",
                 Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  at::Tensor out;
  save_into(&THPVariable_Unpack(arg), &out);  // (throws as the op's kernel would)
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyObject* unpack(PyObject* /*self*/, PyObject* arg) {
  Py_INCREF(arg);
  return arg;
}

// changed(ns, keys, ids) -> the names bound or rebound since, or None. `keys` (a list) and `ids`
// (a bytearray: one uintptr_t per key, its value's address) are the caller's record of `ns` at
// the last call. Where the names now begin with `keys`, the same objects in the same order, the
// record is brought up to date in place (the values that changed, the names added) and the
// names among them whose value is another object are returned, then the names added; else
// (names deleted or moved) nothing is changed and None is returned: the caller compares the two
// as dicts. One pass over the dict that allocates nothing while it runs.
PyObject* changed(PyObject* /*self*/, PyObject* args) {
  PyObject* ns = nullptr;
  PyObject* keys = nullptr;
  PyObject* ids = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!", &PyDict_Type, &ns, &PyList_Type, &keys,
                        &PyByteArray_Type, &ids)) {
    return nullptr;
  }
  const Py_ssize_t width = static_cast<Py_ssize_t>(sizeof(uintptr_t));
  const Py_ssize_t n = PyDict_Size(ns);
  const Py_ssize_t m = PyList_GET_SIZE(keys);
  if (n < m || PyByteArray_GET_SIZE(ids) != m * width) {
    Py_RETURN_NONE;
  }
  std::vector<std::pair<Py_ssize_t, uintptr_t>> moved;  // (position, value's address)
  std::vector<std::pair<PyObject*, uintptr_t>> added;   // (borrowed name, value's address)
  try {
    moved.reserve(16);
    added.reserve(static_cast<size_t>(n - m));
    const auto* before = reinterpret_cast<const uintptr_t*>(PyByteArray_AS_STRING(ids));
    Py_ssize_t pos = 0;
    Py_ssize_t i = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    // (no Python code runs in this loop: the vectors allocate outside Python's heap)
    while (PyDict_Next(ns, &pos, &key, &value)) {
      const auto at = reinterpret_cast<uintptr_t>(value);
      if (i < m) {
        if (PyList_GET_ITEM(keys, i) != key) {
          Py_RETURN_NONE;
        }
        if (before[i] != at) {
          moved.emplace_back(i, at);
        }
      } else {
        added.emplace_back(key, at);
      }
      ++i;
    }
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  // the names, taken before anything below may run Python code (a collection)
  PyObject* names = PyList_New(static_cast<Py_ssize_t>(moved.size() + added.size()));
  if (names == nullptr) {
    return nullptr;
  }
  Py_ssize_t k = 0;
  for (const auto& mv : moved) {
    PyObject* name = PyList_GET_ITEM(keys, mv.first);
    Py_INCREF(name);
    PyList_SET_ITEM(names, k++, name);
  }
  for (const auto& ad : added) {
    Py_INCREF(ad.first);
    PyList_SET_ITEM(names, k++, ad.first);
  }
  // the record, brought up to date (the names added are held by `names` meanwhile)
  if (PyByteArray_Resize(ids, n * width) != 0) {
    Py_DECREF(names);
    return nullptr;
  }
  auto* now = reinterpret_cast<uintptr_t*>(PyByteArray_AS_STRING(ids));
  for (const auto& mv : moved) {
    now[mv.first] = mv.second;
  }
  Py_ssize_t j = m;
  for (const auto& ad : added) {
    now[j++] = ad.second;
    if (PyList_Append(keys, ad.first) != 0) {
      Py_DECREF(names);
      return nullptr;
    }
  }
  return names;
}

PyMethodDef methods[] = {
    {"memlab_pack", pack, METH_O, "memlab's saved-tensor pack hook (tags the saving)."},
    {"memlab_unpack", unpack, METH_O, "memlab's saved-tensor unpack hook (the tensor as is)."},
    {"memlab_changed", changed, METH_VARARGS, "The names of a dict bound or rebound since."},
};

}  // namespace

extern "C" {

// The two hooks, as a tuple of Python functions, once given the record's kernel (its address).
PyObject* mnp_hooks(void* save) {
  save_into = reinterpret_cast<SaveFn>(save);
  PyObject* p = PyCFunction_New(&methods[0], nullptr);
  PyObject* u = p != nullptr ? PyCFunction_New(&methods[1], nullptr) : nullptr;
  if (u == nullptr) {
    Py_XDECREF(p);
    return nullptr;
  }
  return Py_BuildValue("(NN)", p, u);
}

// The namespace scan (`changed`, above), as a Python function.
PyObject* mnp_changed() {
  return PyCFunction_New(&methods[2], nullptr);
}

}  // extern "C"
