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

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

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

PyMethodDef methods[] = {
    {"memlab_pack", pack, METH_O, "memlab's saved-tensor pack hook (tags the saving)."},
    {"memlab_unpack", unpack, METH_O, "memlab's saved-tensor unpack hook (the tensor as is)."},
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

}  // extern "C"
