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

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
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

// The namespace's record between two scans (see `changed`): `keys`, a list, and `ids`, a
// bytearray. Either one entry per name, in the dict's order, with its value's address (8 bytes
// each: the pass over PyDict_Next), or one per slot of the dict's entry table (16 bytes each: the
// key's and the value's address; None in `keys` for a slot left empty by a deletion).

// CPython's combined table (3.11 to 3.14, with the GIL): the keys object's head and a slot of a
// table whose keys are all str. Read only after `slots_readable` saw it laid out so.
struct KeysHead {
  Py_ssize_t refcnt;
  uint8_t log2_size;
  uint8_t log2_index_bytes;
  uint8_t kind;  // 0 any keys, 1 str keys, 2 split (an instance's)
  uint32_t version;
  Py_ssize_t usable;
  Py_ssize_t nentries;
  char indices[8];
};
struct Slot {
  PyObject* key;
  PyObject* value;
};
int layout = -1;  // -1 not checked yet, 0 not as above, 1 as above

// The entry table of `ns` (its slots, into n), or null where it is not a combined table of str
// keys laid out as above.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030F0000 && !defined(Py_GIL_DISABLED)
#define MEMLAB_DICT_SLOTS 1
#endif

const Slot* slots_of(PyObject* ns, Py_ssize_t* n) {
#ifdef MEMLAB_DICT_SLOTS
  auto* d = reinterpret_cast<PyDictObject*>(ns);
  if (d->ma_values != nullptr) {
    return nullptr;
  }
  const auto* k = reinterpret_cast<const KeysHead*>(d->ma_keys);
  if (k->kind != 1 || k->log2_index_bytes > 40 || k->nentries < 0) {
    return nullptr;
  }
  *n = k->nentries;
  return reinterpret_cast<const Slot*>(k->indices + (size_t{1} << k->log2_index_bytes));
#else
  (void)ns;
  (void)n;
  return nullptr;
#endif
}

// Whether this Python's dicts are laid out as `slots_of` reads them: a dict of known names,
// one deleted, read both ways (PyDict_Next and the table). Checked once; where not, the scan
// takes the pass over PyDict_Next.
bool slots_readable() {
#ifdef MEMLAB_DICT_SLOTS
  if (layout >= 0) {
    return layout == 1;
  }
  layout = 0;
  PyObject* d = PyDict_New();
  if (d == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool ok = true;
  char name[32];
  for (int i = 0; i < 40 && ok; ++i) {  // (grown past its first table)
    std::snprintf(name, sizeof(name), "memlab_probe_%d", i);
    PyObject* v = PyLong_FromLong(100000 + i);
    ok = v != nullptr && PyDict_SetItemString(d, name, v) == 0;
    Py_XDECREF(v);
  }
  ok = ok && PyDict_DelItemString(d, "memlab_probe_3") == 0;
  Py_ssize_t n = 0;
  const Slot* slots = ok ? slots_of(d, &n) : nullptr;
  ok = slots != nullptr && n == 40 && slots[3].key == nullptr && slots[3].value == nullptr;
  Py_ssize_t pos = 0, i = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  while (ok && PyDict_Next(d, &pos, &key, &value)) {
    i += i == 3 ? 1 : 0;
    ok = i < n && slots[i].key == key && slots[i].value == value;
    ++i;
  }
  ok = ok && i == 40;
  Py_DECREF(d);
  PyErr_Clear();
  layout = ok ? 1 : 0;
  return ok;
#else
  return false;
#endif
}

// `changed` over the entry table: the slots compared with the record's as memory (a few
// nanoseconds a name, where the pass over PyDict_Next takes 15 to 100), then the names at the
// slots that differ. None where the table is not the one recorded (rebuilt with names deleted).
// Only the slots that differ are copied (the memory a cell reads is the table and the record).
PyObject* changed_slots(PyObject* keys, PyObject* ids, const Slot* now, Py_ssize_t n) {
  const Py_ssize_t m = PyList_GET_SIZE(keys);
  if (n < m) {
    Py_RETURN_NONE;
  }
  const auto* before = reinterpret_cast<const Slot*>(PyByteArray_AS_STRING(ids));
  // the slots that differ, then every slot added (empty ones too), as they are now: copied
  // before any Python code may run (a collection, below, may run code that edits the dict)
  std::vector<Py_ssize_t> at;
  std::vector<Slot> got;
  try {
    at.reserve(static_cast<size_t>(n - m) + 16);
    got.reserve(static_cast<size_t>(n - m) + 16);
    constexpr Py_ssize_t kBlock = 64;
    for (Py_ssize_t b = 0; b < m; b += kBlock) {
      const Py_ssize_t e = std::min(m, b + kBlock);
      if (std::memcmp(before + b, now + b, static_cast<size_t>(e - b) * sizeof(Slot)) == 0) {
        continue;
      }
      for (Py_ssize_t i = b; i < e; ++i) {
        const Slot s = now[i];
        if (s.key != before[i].key && s.key != nullptr) {
          Py_RETURN_NONE;  // another name in the slot: a table rebuilt
        }
        if (s.key != before[i].key || s.value != before[i].value) {
          at.push_back(i);
          got.push_back(s);
        }
      }
    }
    for (Py_ssize_t i = m; i < n; ++i) {
      at.push_back(i);
      got.push_back(now[i]);
    }
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  // the names, held from here: the record's for a slot emptied, the table's for the others
  const size_t k = at.size();
  std::vector<PyObject*> names(k, nullptr);
  for (size_t j = 0; j < k; ++j) {
    names[j] = got[j].key != nullptr ? got[j].key
               : at[j] < m          ? PyList_GET_ITEM(keys, at[j])
                                    : nullptr;  // (an added slot left empty)
    Py_XINCREF(names[j]);
  }
  PyObject* out = PyList_New(0);
  PyObject* gone = nullptr;  // name -> its value's address before, for the names deleted
  PyObject* same = nullptr;  // names deleted and added again with the same value: no change
  bool ok = out != nullptr;
  for (size_t j = 0; ok && j < k; ++j) {
    if (at[j] < m && got[j].key == nullptr) {
      PyObject* was = PyLong_FromVoidPtr(before[at[j]].value);
      ok = was != nullptr && (gone != nullptr || (gone = PyDict_New()) != nullptr) &&
           PyDict_SetItem(gone, names[j], was) == 0;
      Py_XDECREF(was);
    }
  }
  for (size_t j = 0; ok && gone != nullptr && j < k; ++j) {
    if (at[j] >= m && names[j] != nullptr) {  // added: moved, where deleted with this value
      PyObject* was = PyDict_GetItemWithError(gone, names[j]);  // (str keys: no code runs)
      if (was != nullptr && PyLong_AsVoidPtr(was) == got[j].value) {
        ok = (same != nullptr || (same = PySet_New(nullptr)) != nullptr) &&
             PySet_Add(same, names[j]) == 0;
      }
    }
  }
  for (size_t j = 0; ok && j < k; ++j) {
    if (names[j] != nullptr && (same == nullptr || PySet_Contains(same, names[j]) != 1)) {
      ok = PyList_Append(out, names[j]) == 0;
    }
  }
  // the record, brought up to date: a slot emptied lets its name go, the added ones are kept
  for (size_t j = 0; ok && j < k; ++j) {
    if (at[j] < m && got[j].key == nullptr) {
      Py_INCREF(Py_None);
      ok = PyList_SetItem(keys, at[j], Py_None) == 0;
    } else if (at[j] >= m) {  // (held by `names` until here)
      ok = PyList_Append(keys, got[j].key != nullptr ? got[j].key : Py_None) == 0;
    }
  }
  ok = ok && PyByteArray_Resize(ids, n * static_cast<Py_ssize_t>(sizeof(Slot))) == 0;
  if (ok) {
    auto* record = reinterpret_cast<Slot*>(PyByteArray_AS_STRING(ids));
    for (size_t j = 0; j < k; ++j) {
      record[at[j]] = got[j];
    }
  }
  for (PyObject* name : names) {
    Py_XDECREF(name);
  }
  Py_XDECREF(gone);
  Py_XDECREF(same);
  if (!ok) {
    Py_XDECREF(out);
    return nullptr;
  }
  return out;
}

// changed(ns, keys, ids) -> the names bound, rebound or deleted since, or None. `keys` and `ids`
// are the caller's record of `ns` at the last call (see above; both empty: none). Where `ns` is
// laid out as a table of str keys, its slots are compared with the record's; else, and where
// the names now begin with `keys` (the same objects in the same order), one pass over PyDict_Next
// finds the values that changed and the names added. The record is brought up to date in place
// and the names returned; else (the table rebuilt, names deleted or moved, a record of the other
// kind) nothing is changed and None is returned: the caller compares the two as dicts, then
// records afresh (passing an empty record). Allocates nothing while it reads the dict.
PyObject* changed(PyObject* /*self*/, PyObject* args) {
  PyObject* ns = nullptr;
  PyObject* keys = nullptr;
  PyObject* ids = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!", &PyDict_Type, &ns, &PyList_Type, &keys,
                        &PyByteArray_Type, &ids)) {
    return nullptr;
  }
  const Py_ssize_t m = PyList_GET_SIZE(keys);
  const Py_ssize_t size = PyByteArray_GET_SIZE(ids);
  Py_ssize_t slots_n = 0;
  const Slot* slots = slots_readable() ? slots_of(ns, &slots_n) : nullptr;
  if (slots != nullptr && size == m * static_cast<Py_ssize_t>(sizeof(Slot))) {
    return changed_slots(keys, ids, slots, slots_n);
  }
  const Py_ssize_t width = static_cast<Py_ssize_t>(sizeof(uintptr_t));
  const Py_ssize_t n = PyDict_Size(ns);
  if (slots != nullptr || n < m || size != m * width) {
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
