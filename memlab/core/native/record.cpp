// memlab's native record of a region's CPU tensor memory (loaded with ctypes; see record.py).
//
// Two parts, both in C++ so that no Python runs per op:
//  * a CPU allocator that wraps PyTorch's own: every allocation and free made through it is
//    known by address, size and order; while a region is open they are logged;
//  * an observer of the ops a dispatch mode would see, on the region's thread: the storages
//    each op returns mark their allocation as the accounting's (a storage an op returned), and
//    the storages each op reads that predate the region are remembered (weakly) for the
//    ledger. Two routes to the same ops: where PyTorch declares the dispatch key `Fake` (2.13;
//    nothing of PyTorch's is registered at it), a boxed fallback at that key, which sits where
//    a Python dispatch mode does (one boxing per op seen: see mode_fallback); elsewhere a
//    thread-local RecordFunction callback, which sees every op and every op inside one and
//    tells them apart by the dispatch keys excluded on the thread (see on_start).
// What no op returns (a Python number wrapped as a tensor, a kernel's scratch buffer) is logged
// by the allocator but never marked, so the figures are those of tensor accounting.
//
// With a breakdown or a timeline (`keep`), it also logs each event's time and phase (a backward
// found here, the rest told by memlab's hooks through mn_py_phase), each saving for backward
// and its end (memlab's saved-tensor hook is this library's op memlab::saved: an alias that
// logs when autograd lets it go), the leaves that require grad (their gradients are named at
// the end of each backward), and the roles memlab's hooks give (mn_mark). At the end, mn_tally
// replays the region's events with each storage's role, in one pass.
//
// One region at a time, process-wide (mn_begin answers 1 when one is open). The wrapper stays
// installed from the first region on (so that frees of tensors made between regions are seen
// in order) until mn_uninstall, which puts PyTorch's allocator back; blocks it handed out keep
// its deleter, which frees them through the allocator that made them.

#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <pthread.h>
#include <time.h>

#include <algorithm>

// The phase the Python side says the program is in (memlab.core.recorder.Phase: forward,
// optimizer, a label, other); a backward is found here (see phase_now). Written by its hooks.
extern "C" {
int mn_py_phase = 0;
}

#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

struct Block {
  int64_t size;
  c10::DeleterFnPtr free_fn;
  uint64_t region;  // the region it was allocated in (0: none open)
  int64_t index;    // its index in `allocs` if allocated in the open region
};

struct Alloc {
  uintptr_t ptr;
  int64_t size;
  int64_t seq;       // order of the allocation among the region's events
  int64_t free_seq;  // order of its free, -1 while alive
  c10::StorageImpl* storage;  // weakly held once an op returned it, else null
  // Not a block of this region's: a storage an op returned that the record had not met
  // (memory from numpy, a file mapping or shared memory; an older block handed to set_). Its
  // bytes count from `seq`; its free is placed by address where it was an older block of the
  // wrapper's, else not at all.
  bool adopted;
  bool older_block;  // adopted, and an older block of the wrapper's (its free is in the log)
  // Its storage moved on to a newer block of this region (grown by an op or resize_): its
  // bytes leave at the newer block's place (a Move), and its own free is not counted.
  bool superseded;
  // Allocated on a thread the record does not follow (started before the region, not by it).
  bool foreign;
};

struct Freed {
  uintptr_t ptr;
  int64_t size;
  int64_t seq;
};

struct Read {
  c10::StorageImpl* storage;  // weakly held
  uintptr_t ptr;
  int64_t size;
  bool taken;  // returned later by an op in its block of this region: the region's, not read
  bool moved;  // grown by an op into a block of this region (its Move is made)
};

// Made once and never destroyed: PyTorch frees tensors during the process's exit, after this
// library's static objects would have been destroyed.
std::mutex& mu = *new std::mutex();
std::unordered_map<uintptr_t, Block>& live = *new std::unordered_map<uintptr_t, Block>();
c10::Allocator* original = nullptr;
bool installed = false;
uint64_t region = 0;  // the open region's number; 0 when none is open
uint64_t regions = 0;
int64_t seq = 0;
int64_t limit = 10'000'000;  // events kept per region; beyond it the region is lost
// Blocks the wrapper handed out that no followed op returned (while no region was open, or in
// one by code the record does not follow: another thread, a kernel's cache), since it loaded:
// where it has not moved since the namespace was last looked at, nothing new can be in it
// (memlab/core/known.py, make_known).
int64_t unfollowed = 0;
// The region the calling thread's allocations belong to (the one it opened or joined).
thread_local uint64_t followed_region = 0;
// Of the region's blocks alive at its end that a thread it does not follow allocated: how many
// and their bytes (not in its figures: said in its notes).
int64_t foreign_blocks = 0;
int64_t foreign_bytes = 0;
bool overflow = false;
// With a breakdown (`keep`): each event's time (CLOCK_MONOTONIC, ns: perf_counter's clock) and
// phase, by sequence number.
bool keep = false;
std::vector<int64_t>& ev_ns = *new std::vector<int64_t>();
std::vector<int8_t>& ev_phase = *new std::vector<int8_t>();
std::vector<Alloc>& allocs = *new std::vector<Alloc>();
std::vector<Freed>& earlier_frees = *new std::vector<Freed>();  // of blocks from before
std::vector<Read>& reads = *new std::vector<Read>();
// A storage resized in place: its place in the order, the bytes added, and (with a breakdown)
// the storage, weakly held in `resize_keys`.
struct Resize {
  int64_t seq;
  int64_t added;
  c10::StorageImpl* storage;
};
std::vector<Resize>& resizes = *new std::vector<Resize>();
std::unordered_set<c10::StorageImpl*>& resize_keys = *new std::unordered_set<c10::StorageImpl*>();
// Storages already looked at as an op's input in this region, or returned by one: a later read
// of them costs one look-up. (Each is alive, or weakly held, for the region: no address reuse.)
// Each one is weakly held while in here (so that its address is not reused in the region).
std::unordered_set<c10::StorageImpl*>& read_seen = *new std::unordered_set<c10::StorageImpl*>();
// Index in `reads` of each storage read as older memory.
std::unordered_map<c10::StorageImpl*, size_t>& read_index =
    *new std::unordered_map<c10::StorageImpl*, size_t>();
// Storages the ledger was handed before, read in this region: their block when read.
std::unordered_map<c10::StorageImpl*, std::pair<uintptr_t, int64_t>>& reported_reads =
    *new std::unordered_map<c10::StorageImpl*, std::pair<uintptr_t, int64_t>>();
// Older storages an op moved into a block of this region (grown by out= or resize_): their old
// size, netted against the new block
// (As the dispatch mode's ledger sees it: the storage changes size when the op returns, so the
// old bytes leave at the new block's place in the order; the copy's moment with both alive is
// the kernel's, as its scratch memory is.)
struct Move {
  int64_t seq;        // the new block's allocation
  int64_t size;       // the old size
  uintptr_t old_ptr;  // the old block (its free, if the ledger reports it, is this Move's)
  c10::StorageImpl* storage;  // the storage that moved (weakly held elsewhere)
};
std::vector<Move>& moves = *new std::vector<Move>();
// The block of this region each storage an op returned lives in now (index in `allocs`).
std::unordered_map<c10::StorageImpl*, size_t>& current =
    *new std::unordered_map<c10::StorageImpl*, size_t>();
// With a breakdown: the storages from before the region it touched (read, saved for backward,
// given a role), each weakly held by one of the sets that met it: its block and size when
// first met, and whether an op read it (an input, where nothing else names its role).
struct Older {
  uintptr_t ptr;
  int64_t size;
  bool read;
  c10::TensorImpl* reader = nullptr;  // the tensor an op first read it through (weakly held)
};
// The storages from before the region first read by the op being looked at: their reader is
// set by leaves_of_inputs.
std::vector<c10::StorageImpl*>& fresh_older = *new std::vector<c10::StorageImpl*>();
std::unordered_map<c10::StorageImpl*, Older>& older =
    *new std::unordered_map<c10::StorageImpl*, Older>();
// The order `mn_older` handed them out in (the roles the caller gives back follow it).
std::vector<c10::StorageImpl*>& older_order = *new std::vector<c10::StorageImpl*>();
// With a breakdown: storages adopted in this region (see Alloc), which are the region's.
std::unordered_set<c10::StorageImpl*>& adopted_keys = *new std::unordered_set<c10::StorageImpl*>();
// Adopted storages not of the wrapper's memory, alive when last looked at (indexes in
// `allocs`): their free cannot be seen, so each op looks whether they died since (a
// DataLoader's batches in shared memory come and go; few are alive at once).
std::vector<size_t>& adopted_alive = *new std::vector<size_t>();
// Storages from before the region, read in it, by the address of their block when read (each
// weakly held in `read_seen`): how the free of an earlier block finds its storage (see
// counted_free).
std::unordered_map<uintptr_t, c10::StorageImpl*>& older_by_ptr =
    *new std::unordered_map<uintptr_t, c10::StorageImpl*>();
// Storages from before the region whose earlier block was swapped for memory not of the
// wrapper's (see counted_free): that block's free is logged when the storage dies.
struct Swapped {
  c10::StorageImpl* storage;  // weakly held in `read_seen`
  uintptr_t ptr;              // the earlier block
  int64_t size;
};
std::vector<Swapped>& swapped_older = *new std::vector<Swapped>();

constexpr int8_t kBackward = 2;  // Phase.BACKWARD

// The phase of the op the fallback runs on this thread (-1: none), found once per op for the
// allocations it makes.
thread_local int8_t op_phase = -1;

int8_t phase_now() {
  if (op_phase >= 0) {
    return op_phase;
  }
  if (torch::autograd::get_current_node() != nullptr) {
    return kBackward;  // an op of a backward function, on the engine's thread
  }
  return static_cast<int8_t>(mn_py_phase);
}

// The next event's sequence number; with a breakdown, its time and phase are logged. Under `mu`.
int64_t stamp() {
  if (keep) {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ev_ns.push_back(static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec);
    ev_phase.push_back(phase_now());
  }
  return seq++;
}

// The adopted storages that died since the last look: freed here in the order. Under `mu`.
void look_at_adopted() {
  size_t kept = 0;
  for (size_t i : adopted_alive) {
    Alloc& a = allocs[i];
    if (c10::raw::weak_intrusive_ptr::use_count(a.storage) == 0) {
      a.free_seq = stamp();
    } else {
      adopted_alive[kept++] = i;
    }
  }
  adopted_alive.resize(kept);
  kept = 0;
  for (const Swapped& w : swapped_older) {
    if (c10::raw::weak_intrusive_ptr::use_count(w.storage) == 0) {
      if (earlier_frees.size() < static_cast<size_t>(limit)) {
        earlier_frees.push_back({w.ptr, w.size, stamp()});
      } else {
        overflow = true;
      }
    } else {
      swapped_older[kept++] = w;
    }
  }
  swapped_older.resize(kept);
}

// Whether some storage's free is looked for at each op (look_at_adopted). Under `mu`.
bool watching() {
  return !adopted_alive.empty() || !swapped_older.empty();
}

// Whether `s`, whose block at `ptr` the wrapper is freeing, lives on in memory not of the
// wrapper's: UntypedStorage.share_memory_ (_share_fd_cpu_, _share_filename_cpu_) copies a
// storage into shared memory and hands that memory to the same storage in place, and only
// then is the old block freed. The storage's bytes did not leave (the dispatch mode's ledger
// still holds it, at its size): its free is that of the storage, looked for at each op. A
// storage that is dying (no strong reference), emptied, or moved to another block of the
// wrapper's (resize_, followed elsewhere) is freed here as usual. Under `mu`.
bool swapped_out(c10::StorageImpl* s, uintptr_t ptr) {
  if (s == nullptr || c10::raw::weak_intrusive_ptr::use_count(s) == 0) {
    return false;
  }
  const auto now = reinterpret_cast<uintptr_t>(s->data_ptr().get());
  return now != 0 && now != ptr && live.count(now) == 0;
}
// Storages already handed to the ledger (weakly held, so an address is never reused while in
// here): a later region's reads skip them. Pruned of the dead as it grows.
std::unordered_set<c10::StorageImpl*>& reported = *new std::unordered_set<c10::StorageImpl*>();
size_t prune_at = 4096;
int64_t reported_to = 0;  // the ledger they were handed to (its Python identity)
at::CallbackHandle handle = 0;
int64_t marked = 0;
bool transformed = false;  // the RecordFunction route saw ops inside a torch.func transform
bool held = false;  // from a region's start until its record is released (read)
// Whether this thread includes the dispatch key of the key route (see mode_fallback).
thread_local bool key_included = false;

#ifdef MN_MODE_KEY
constexpr c10::DispatchKey kModeKey = c10::DispatchKey::Fake;

void key_off() {  // the key route's key off the calling thread
  c10::impl::tls_set_dispatch_key_included(kModeKey, false);
  key_included = false;
}
#endif

void counted_free(void* p) {
  c10::DeleterFnPtr free_fn = nullptr;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = live.find(reinterpret_cast<uintptr_t>(p));
    if (it != live.end()) {
      Block& b = it->second;
      free_fn = b.free_fn;
      if (region != 0) {
        auto ob = b.region == region ? older_by_ptr.end() : older_by_ptr.find(it->first);
        if (b.region == region) {
          Alloc& a = allocs[b.index];
          if (!a.superseded && swapped_out(a.storage, it->first)) {
            adopted_alive.push_back(static_cast<size_t>(b.index));  // freed when it dies
          } else {
            a.free_seq = stamp();
          }
        } else if (ob != older_by_ptr.end() && swapped_out(ob->second, it->first)) {
          swapped_older.push_back({ob->second, it->first, b.size});  // freed when it dies
        } else if (earlier_frees.size() < static_cast<size_t>(limit)) {
          earlier_frees.push_back({it->first, b.size, stamp()});
        } else {
          overflow = true;
        }
        if (ob != older_by_ptr.end()) {
          older_by_ptr.erase(ob);
        }
      }
      live.erase(it);
    }
  }
  if (free_fn != nullptr) {
    free_fn(p);
  }
}

struct Wrapper final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = original->allocate(n);
    void* data = dp.get();
    // Only the common form (context == data) is followed; any other passes through untouched.
    if (data == nullptr || dp.get_context() != data) {
      return dp;
    }
    c10::DeleterFnPtr free_fn = dp.get_deleter();
    c10::Device device = dp.device();
    dp.release_context();
    const auto key = reinterpret_cast<uintptr_t>(data);
    {
      std::lock_guard<std::mutex> g(mu);
      Block b{static_cast<int64_t>(n), free_fn, 0, -1};
      if (region != 0) {
        if (allocs.size() < static_cast<size_t>(limit)) {
          b.region = region;
          b.index = static_cast<int64_t>(allocs.size());
          allocs.push_back({key, static_cast<int64_t>(n), stamp(), -1, nullptr, false, false,
                            false, followed_region != region});
        } else {
          overflow = true;
          ++unfollowed;
        }
      } else {
        ++unfollowed;
      }
      live[key] = b;
    }
    return c10::DataPtr(data, data, &counted_free, device);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &counted_free;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

Wrapper& wrapper = *new Wrapper();

// A fork while another thread holds the lock would leave the child's copy locked forever: the
// lock is taken around fork, and the child, which has no region open, logs nothing.
void before_fork() {
  mu.lock();
}
void after_fork_parent() {
  mu.unlock();
}
void after_fork_child() {
  region = 0;
  held = false;
  if (handle != 0) {  // the forking thread's callback: the child has no region open
    at::removeCallback(handle);
  }
  handle = 0;
#ifdef MN_MODE_KEY
  if (key_included) {  // forked inside a region, on its thread: the child has none open
    key_off();
  }
#endif
  mu.unlock();
}
const int fork_handlers = pthread_atfork(&before_fork, &after_fork_parent, &after_fork_child);

template <typename F>
void each_storage(const at::Tensor& t, F&& f) {
  if (!t.defined()) {
    return;
  }
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_wrapped_number()) {
    return;  // a Python number made a tensor for the op: a dispatch mode sees the number
  }
  const auto layout = impl->layout();
  if (layout == c10::kStrided) {
    if (impl->has_storage()) {  // read without taking a reference: the tensor holds one
      f(impl->unsafe_storage().unsafeGetStorageImpl());
    }
  } else if (layout == c10::kSparse) {
    auto* sparse = static_cast<at::SparseTensorImpl*>(impl);
    each_storage(sparse->indices(), f);
    each_storage(sparse->values(), f);
  } else if (layout == c10::kSparseCsr || layout == c10::kSparseCsc ||
             layout == c10::kSparseBsr || layout == c10::kSparseBsc) {
    auto* compressed = static_cast<at::SparseCsrTensorImpl*>(impl);
    each_storage(compressed->compressed_indices(), f);
    each_storage(compressed->plain_indices(), f);
    each_storage(compressed->values(), f);
  }
}

template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    each_storage(v.toTensor(), f);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      each_storage(t, f);
    }
  } else if (v.isList()) {
    for (const c10::IValue& w : v.toListRef()) {
      if (w.isTensor()) {
        each_storage(w.toTensor(), f);
      }
    }
  } else if (v.isTuple()) {
    for (const c10::IValue& w : v.toTupleRef().elements()) {
      if (w.isTensor()) {
        each_storage(w.toTensor(), f);
      }
    }
  }
}

bool is_cpu(c10::StorageImpl* s) {
  return s->device_type() == c10::DeviceType::CPU;
}

// Which ops the dispatch mode's accounting sees, followed here. A dispatch mode sits below
// autograd: it sees the ops called from Python, by the autograd engine, by autograd's own layer
// of an op (a saved-tensor hook's copy) and by a composite op that autograd decomposes; not the
// ops a kernel calls inside itself (a Python number made a tensor, a dtype conversion), which
// run below autograd, with its keys excluded on the thread. So an op called inside a seen op is
// seen where autograd is still above it, and an op called with autograd already excluded (a
// kernel's inside, inference mode) sees nothing inside itself. Per thread, a stack of the
// records open: 0 not seen, 1 seen, 2 seen but with autograd excluded (what it calls is not),
// 3 not an op (a record the autograd engine opens around a backward function).
thread_local std::vector<char> running;
thread_local std::unordered_set<const char*> op_names;

// The last names found to be ops, by a hash of their address (a look-up in a few nanoseconds).
thread_local const char* recent_ops[256] = {};

bool is_op(const at::RecordFunction& fn) {
  const char* name = fn.name();
  const size_t slot = (reinterpret_cast<uintptr_t>(name) >> 4) & 255;
  if (recent_ops[slot] == name) {
    return true;
  }
  if (op_names.count(name) != 0) {  // an op's name lives in its schema: a stable address
    recent_ops[slot] = name;
    return true;
  }
  if (!fn.operator_name()) {
    return false;  // never remembered: such a record's name is its own string
  }
  op_names.insert(name);
  recent_ops[slot] = name;
  return true;
}

int parent_frame() {  // an int: plain char is unsigned on some machines
  for (auto it = running.rbegin(); it != running.rend(); ++it) {
    if (*it != 3) {
      return *it;
    }
  }
  return -1;  // none: called from Python
}

// Weak references to give up once `mu` is released: the last one can delete a storage object
// that still holds a tensor (a functional tensor's storage holds its base), whose memory is
// then freed through the wrapper, which takes `mu`.
std::vector<c10::StorageImpl*>& to_release = *new std::vector<c10::StorageImpl*>();

std::vector<c10::TensorImpl*>& to_release_impls = *new std::vector<c10::TensorImpl*>();

void release_deferred() {  // never under `mu`
  std::vector<c10::StorageImpl*> now;
  std::vector<c10::TensorImpl*> impls;
  {
    std::lock_guard<std::mutex> g(mu);
    now.swap(to_release);
    impls.swap(to_release_impls);
  }
  for (c10::StorageImpl* s : now) {
    c10::raw::weak_intrusive_ptr::decref(s);
  }
  for (c10::TensorImpl* t : impls) {
    c10::raw::weak_intrusive_ptr::decref(t);
  }
}

// Puts `p` in a set that holds its members weakly (one weak count each, given up when the set
// is emptied), once.
template <typename Set, typename T>
void hold(Set& set, T* p) {
  if (set.insert(p).second) {
    c10::raw::weak_intrusive_ptr::incref(p);
  }
}

// Gives `s` the role `code` in a map that holds its keys weakly (the stronger of two roles:
// the lower code).
void keep_stronger(std::unordered_map<c10::StorageImpl*, int>& roles, c10::StorageImpl* s,
                   int code) {
  auto it = roles.find(s);
  if (it == roles.end()) {
    c10::raw::weak_intrusive_ptr::incref(s);
    roles.emplace(s, code);
  } else if (code < it->second) {
    it->second = code;
  }
}

void seen(c10::StorageImpl* s) {  // under `mu`
  hold(read_seen, s);
}

// A storage an op read: remembered (weakly) where it predates the region, once. Under `mu`.
void read_storage(c10::StorageImpl* s) {
  if (!is_cpu(s)) {
    return;
  }
  if (read_seen.count(s) != 0) {  // the common case: one look-up
    return;
  }
  const auto key = reinterpret_cast<uintptr_t>(s->data_ptr().get());
  if (key == 0) {
    return;  // no memory (nor held: a functional tensor's storage would keep its base alive)
  }
  seen(s);
  const auto nbytes = static_cast<int64_t>(s->nbytes());
  if (reported.count(s) != 0) {  // the ledger has it: only its block, should an op move it
    reported_reads.emplace(s, std::make_pair(key, nbytes));
    older_by_ptr[key] = s;
    if (keep) {
      auto o = older.emplace(s, Older{key, nbytes, true});
      o.first->second.read = true;
      if (o.first->second.reader == nullptr) {
        fresh_older.push_back(s);
      }
    }
    return;
  }
  auto it = live.find(key);
  if (it != live.end() && it->second.region == region && it->second.index >= 0 &&
      allocs[it->second.index].storage == s) {
    return;  // memory an op returned in this region: the region's, not something read
  }
  // older memory; or a block of this region no op the record saw returned (made by another
  // thread, or the data `torch.tensor` is about to lift): read, unless an op returns it later
  if (keep) {
    auto o = older.emplace(s, Older{key, nbytes, true});
    o.first->second.read = true;
    if (o.first->second.reader == nullptr) {
      fresh_older.push_back(s);
    }
  }
  c10::raw::weak_intrusive_ptr::incref(s);
  older_by_ptr[key] = s;
  read_index[s] = reads.size();
  reads.push_back({s, key, nbytes, false, false});
}

// A storage an op returned: the allocation behind it, if new in the region, is the
// accounting's; one the record had not met is adopted. Under `mu`.
void returned_storage(c10::StorageImpl* s) {
  if (!is_cpu(s)) {
    return;
  }
  const auto key = reinterpret_cast<uintptr_t>(s->data_ptr().get());
  auto it = live.find(key);
  if (it != live.end() && it->second.region == region && it->second.index >= 0) {
    Alloc& a = allocs[it->second.index];
    if (a.storage != nullptr) {
      return;
    }
    c10::raw::weak_intrusive_ptr::incref(s);
    a.storage = s;
    ++marked;
    const size_t index = static_cast<size_t>(it->second.index);
    auto cur = current.find(s);
    auto r = read_index.find(s);
    auto rr = reported_reads.find(s);
    if (cur != current.end()) {  // a storage of this region, grown again into this block
      Alloc& before = allocs[cur->second];
      moves.push_back({a.seq, before.size, before.ptr, s});
      before.superseded = true;
    } else if (r != read_index.end()) {
      Read& read = reads[r->second];
      if (read.ptr == key) {
        read.taken = true;  // its own block, read before an op returned it: the region's
        auto o = older.find(s);
        if (o != older.end()) {
          if (o->second.reader != nullptr) {
            to_release_impls.push_back(o->second.reader);
          }
          older.erase(o);
        }
      } else if (!read.moved) {  // an older storage, grown into this block
        moves.push_back({a.seq, read.size, read.ptr, s});
        read.moved = true;
      }
    } else if (rr != reported_reads.end() && rr->second.first != key) {
      moves.push_back({a.seq, rr->second.second, rr->second.first, s});
      reported_reads.erase(rr);
    }
    current[s] = index;
    seen(s);  // when read later: this region's, nothing to look up
    return;
  }
  if (key == 0 || read_seen.count(s) != 0 || reported.count(s) != 0) {
    return;  // no memory, read before (older memory), or the ledger's already
  }
  if (allocs.size() >= static_cast<size_t>(limit)) {
    overflow = true;
    return;
  }
  c10::raw::weak_intrusive_ptr::incref(s);
  const bool older_block = live.count(key) != 0;
  if (!older_block) {  // not the wrapper's: its free is looked for at each op
    adopted_alive.push_back(allocs.size());
  }
  if (keep) {
    adopted_keys.insert(s);
  }
  allocs.push_back(
      {key, static_cast<int64_t>(s->nbytes()), stamp(), -1, s, true, older_block, false, false});
  ++marked;
  seen(s);
}

// ---- the breakdown: roles, saved tensors, gradients (only while `keep`) --------------------

// Whether a storage is this region's new memory (an op returned it in a block of this region,
// or adopted it), rather than one from before it. Under `mu`.
bool is_new(c10::StorageImpl* s) {
  return older.count(s) == 0 && (current.count(s) != 0 || adopted_keys.count(s) != 0);
}

// A storage from before the region met by a role or a save (not an op's read). Under `mu`.
void met_older(c10::StorageImpl* s) {
  if (older.count(s) != 0) {
    return;
  }
  const auto key = reinterpret_cast<uintptr_t>(s->data_ptr().get());
  older.emplace(s, Older{key, static_cast<int64_t>(s->nbytes()), false});
}

// Storages the ledger holds with a lasting role (parameter, gradient, ...), by the code of it
// when last told (weakly held; for the ledger the reported storages were handed to): a
// breakdown sums those it did not move once, from the ledger, not one by one.
std::unordered_map<c10::StorageImpl*, int>& sticky = *new std::unordered_map<c10::StorageImpl*, int>();

// Roles given in the region, by storage (weakly held): codes of memlab.core.categories
// (PRIORITY + 1; lower is stronger; 0 none).
std::unordered_map<c10::StorageImpl*, int>& marks = *new std::unordered_map<c10::StorageImpl*, int>();

void mark_storage(c10::StorageImpl* s, int code) {  // under `mu`
  if (!is_cpu(s) || code <= 0 || s->data_ptr().get() == nullptr) {
    return;
  }
  keep_stronger(marks, s, code);
  if (!is_new(s)) {
    met_older(s);
  }
}

// Saving for backward: +1 when autograd saves a tensor on the storage, -1 when it lets go.
struct Save {
  int64_t seq;
  c10::StorageImpl* storage;  // weakly held in `save_keys`
  int delta;
};
std::vector<Save>& saves = *new std::vector<Save>();
std::unordered_set<c10::StorageImpl*>& save_keys = *new std::unordered_set<c10::StorageImpl*>();

struct SavedAlias;
// The aliases saved in this region that are alive: handed to the ledger at the end.
std::unordered_set<SavedAlias*>& aliases = *new std::unordered_set<SavedAlias*>();

void saved_event(c10::StorageImpl* s, int delta) {  // under `mu`, with a breakdown open
  hold(save_keys, s);
  if (!is_new(s)) {
    met_older(s);
  }
  saves.push_back({stamp(), s, delta});
}

// What memlab's saved-tensor hook packs: an alias of the saved tensor (as detach() makes, no
// autograd history, so a saved output does not hold itself) that logs when autograd lets it
// go. Its storage is held by the alias itself until then.
struct SavedAlias final : c10::TensorImpl {
  SavedAlias(c10::Storage storage, c10::DispatchKeySet ks, caffe2::TypeMeta dtype)
      : c10::TensorImpl(std::move(storage), ks, dtype) {}
  static void copy_from(const c10::TensorImpl* src, SavedAlias* dest) {
    copy_tensor_metadata(src, dest, src->version_counter(), false);
  }
  // Its storage when saved, where its saving is logged (weakly held: code may `set_` the
  // alias to other memory; its address is never reused while the alias lives).
  c10::StorageImpl* key = nullptr;
  // Its last strong reference went: released (where weak references remain) or deleted.
  void release_resources() override {
    gone();
    c10::TensorImpl::release_resources();
  }
  ~SavedAlias() override {
    gone();
  }

 private:
  void gone() {  // its storage is still held here
    if (key != nullptr) {
      std::lock_guard<std::mutex> g(mu);
      aliases.erase(this);
      if (region != 0 && keep) {  // this region's, or an older one's the ledger took over
        saved_event(key, -1);
      }
      to_release.push_back(key);  // (its weak reference, given up outside `mu`)
      key = nullptr;
    }
  }
};

at::Tensor saved_kernel(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (typeid(*impl) != typeid(c10::TensorImpl) || !impl->has_storage() ||
      impl->layout() != c10::kStrided || impl->key_set().has(c10::DispatchKey::Python) ||
      !is_cpu(impl->unsafe_storage().unsafeGetStorageImpl())) {
    // a subclass (of C++'s, or of Python's with its own dispatch), sparse, or not CPU memory:
    // saved as the hook always did, its saving not logged
    return t.detach();
  }
  auto alias = c10::make_intrusive<SavedAlias>(c10::Storage(impl->storage()), impl->key_set(),
                                               impl->dtype());
  SavedAlias::copy_from(impl, alias.get());
  alias->set_autograd_meta(nullptr);
  {
    std::lock_guard<std::mutex> g(mu);
    if (region != 0 && keep) {
      c10::StorageImpl* s = impl->unsafe_storage().unsafeGetStorageImpl();
      c10::raw::weak_intrusive_ptr::incref(s);
      alias->key = s;
      aliases.insert(alias.get());
      saved_event(s, +1);
    }
  }
  return at::Tensor(std::move(alias));
}

torch::Library* saved_lib = nullptr;
torch::Library* saved_impl = nullptr;

// The op memlab's pack hook calls (memlab::saved); 0 registered (now or before), 1 failed.
int register_saved_op() {
  if (saved_impl != nullptr) {
    return 0;
  }
  try {
    if (!c10::Dispatcher::singleton().findSchema({"memlab::saved", ""}).has_value()) {
      saved_lib = new torch::Library(torch::Library::DEF, "memlab", std::nullopt, __FILE__, __LINE__);
      saved_lib->def("saved(Tensor(a) self) -> Tensor(a)");
    }
    saved_impl = new torch::Library(torch::Library::IMPL, "memlab",
                                    c10::DispatchKey::CompositeImplicitAutograd, __FILE__, __LINE__);
    saved_impl->impl("saved", &saved_kernel);
  } catch (...) {
    return 1;
  }
  return 0;
}

// Leaves that require grad, met as an op's input or in a backward's graph (weakly held): their
// gradients are named at the end of each backward and of the region.
std::unordered_set<c10::TensorImpl*>& leaves = *new std::unordered_set<c10::TensorImpl*>();
// Tensors Python was handed by mn_typed and found to be no parameter (weakly held, across
// regions): not handed out again (a model's input, read again at every step).
std::unordered_set<c10::TensorImpl*>& plain = *new std::unordered_set<c10::TensorImpl*>();
size_t plain_prune_at = 4096;
// The graph tasks a callback is queued on, the outermost first. A backward run inside another
// (a reentrant checkpoint's) ends before it, and gradients are named when the outermost ends, as
// the dispatch mode names them: a leaf made inside a backward and gone by its end (the
// checkpoint's detached input) is no parameter, and its gradient is the outer backward's
// temporary. A task whose backward raised never runs its callback: the next op outside any
// backward finds it left, and drops it.
std::vector<int>& queued_tasks = *new std::vector<int>();
// The autograd nodes whose leaves were looked for in this region (a graph walked once).
std::unordered_set<torch::autograd::Node*>& walked = *new std::unordered_set<torch::autograd::Node*>();
constexpr int kGradient = 5;  // Category.GRADIENT's code (PRIORITY + 1)

// A tensor that wraps another (torch.func.grad's inputs are such wrappers, as are vmap's and
// functionalization's) keeps the one it wraps until its own last weak reference goes: held
// weakly here, it would keep the program's tensor alive to the region's end, counted there.
bool wraps_another(const c10::TensorImpl* impl) {
  const c10::DispatchKeySet ks = impl->key_set();
  return ks.has(c10::DispatchKey::FuncTorchGradWrapper) ||
         ks.has(c10::DispatchKey::FuncTorchBatched) || ks.has(c10::DispatchKey::Functionalize);
}

void remember_leaf(c10::TensorImpl* impl) {  // under `mu`
  if (!wraps_another(impl)) {
    hold(leaves, impl);
  }
}

// An op's input (after read_storage met its storages): its leaves, and the tensors through
// which storages from before the region were first read (a frozen parameter's type, which
// only Python can tell, is looked at through them at the end). Under `mu`.
void leaves_of_inputs(const c10::IValue& v) {
  auto one = [](const at::Tensor& t) {
    if (!t.defined()) {
      return;
    }
    if (!fresh_older.empty() && t.unsafeGetTensorImpl()->has_storage()) {
      c10::StorageImpl* s = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
      auto o = older.find(s);
      if (o != older.end() && o->second.reader == nullptr &&
          !wraps_another(t.unsafeGetTensorImpl())) {
        c10::raw::weak_intrusive_ptr::incref(t.unsafeGetTensorImpl());
        o->second.reader = t.unsafeGetTensorImpl();
      }
    }
    if (t.requires_grad() && t.is_leaf()) {
      remember_leaf(t.unsafeGetTensorImpl());
    }
  };
  if (v.isTensor()) {
    one(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      one(t);
    }
  }
  fresh_older.clear();
}

void mark_grads() {  // under `mu`
  for (c10::TensorImpl* impl : leaves) {
    if (c10::raw::weak_intrusive_ptr::use_count(impl) == 0) {
      continue;
    }
    const at::Tensor& g = impl->grad();
    if (g.defined()) {
      each_storage(g, [](c10::StorageImpl* s) { mark_storage(s, kGradient); });
    }
  }
}

void after_backward() {
  std::lock_guard<std::mutex> g(mu);
  // (the task ending, and those queued after it: run inside it, they raised)
  const int task = torch::autograd::get_current_graph_task_id();
  auto at = std::find(queued_tasks.begin(), queued_tasks.end(), task);
  if (at == queued_tasks.end() && !queued_tasks.empty()) {
    at = queued_tasks.end() - 1;  // (not found: the last one queued)
  }
  queued_tasks.erase(at, queued_tasks.end());
  if (region != 0 && keep && queued_tasks.empty()) {
    mark_grads();
  }
}

// The first op of a backward: the leaves its graph reaches (a region that runs only backward
// never saw the forward's inputs; nodes walked before in the region are not walked again).
// Under `mu`; returns whether a callback is to be queued. (A plain pointer: PyTorch holds
// nodes in a shared_ptr up to 2.12 and in an intrusive_ptr from 2.13.)
bool backward_begins(torch::autograd::Node* node) {
  if (node == nullptr) {
    if (!queued_tasks.empty()) {
      queued_tasks.clear();  // no backward runs: those left raised (their callbacks never ran)
    }
    return false;
  }
  const int task = torch::autograd::get_current_graph_task_id();
  if (std::find(queued_tasks.begin(), queued_tasks.end(), task) != queued_tasks.end()) {
    return false;
  }
  queued_tasks.push_back(task);
  if (!walked.insert(node).second) {
    return true;
  }
  std::vector<torch::autograd::Node*> todo{node};
  std::unordered_set<torch::autograd::Node*>& met = walked;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) {
      if (acc->variable.defined()) {
        remember_leaf(acc->variable.unsafeGetTensorImpl());
      }
    }
    for (const auto& e : n->next_edges()) {
      torch::autograd::Node* next = e.function.get();
      if (next != nullptr && met.insert(next).second) {
        todo.push_back(next);
      }
    }
  }
  return true;
}

void queue_after_backward() {  // never under `mu` (the engine's lock is taken)
  try {
    torch::autograd::Engine::get_default_engine().queue_callback(&after_backward);
  } catch (...) {
    std::lock_guard<std::mutex> g(mu);
    if (!queued_tasks.empty()) {
      queued_tasks.pop_back();
    }
  }
}

// The RecordFunction route: an op read these storages.
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  char seen = 3;
  if (is_op(fn)) {
    const bool below =
        c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutogradFunctionality);
    const int parent = parent_frame();
    if (parent == -1) {
      seen = below ? 2 : 1;
    } else {
      seen = (parent == 1 && !below) ? 1 : 0;
    }
  }
  running.push_back(seen);
  if (seen == 0 || seen == 3) {
    return nullptr;
  }
  std::unique_lock<std::mutex> g(mu);
  if (region == 0) {
    return nullptr;
  }
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    // inside a torch.func transform: its layers run the ops on plain tensors inside kernels of
    // their own, where this route does not follow them (the dispatch-key route does)
    transformed = true;
  }
  if (watching()) {
    look_at_adopted();
  }
  if (std::strcmp(fn.name(), "aten::lift_fresh") == 0) {
    return nullptr;  // its input is the region's new data, not read (see mode_fallback)
  }
  bool subclass = false;
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor() && v.toTensor().defined() &&
        v.toTensor().key_set().has(c10::DispatchKey::Python)) {
      subclass = true;  // a tensor subclass's own Python code runs this op: the ops it calls
    }
    each_tensor(v, read_storage);
    if (keep) {
      leaves_of_inputs(v);
    }
  }
  if (subclass) {  // are seen, as a dispatch mode above the subclass sees them
    running.back() = 1;
  }
  const bool queue = keep && backward_begins(torch::autograd::get_current_node().get());
  g.unlock();
  if (queue) {
    queue_after_backward();
  }
  return nullptr;
}

// The RecordFunction route: an op returned these storages.
void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  char seen = 0;
  if (!running.empty()) {
    seen = running.back();
    running.pop_back();
  }
  if (seen == 0 || seen == 3) {
    return;
  }
  std::lock_guard<std::mutex> g(mu);
  if (region == 0) {
    return;
  }
  for (const c10::IValue& v : fn.outputs()) {
    each_tensor(v, returned_storage);
  }
}

#ifdef MN_MODE_KEY
// The dispatch-key route (where PyTorch has a key of a dispatch mode's rank that nothing uses:
// `Fake`, below autograd and the Python key, above the backends): while a region is open, the
// key is included on its thread (and so on the autograd engine's, which copies the thread's
// state), and this boxed fallback sees every op a Python dispatch mode would see, with no
// record made for the ops a kernel calls inside itself (the key is excluded while the kernel
// runs, as a Python mode is while its __torch_dispatch__ runs). An op costs one boxing.
//
// Code that saves a thread's whole set of included keys and puts it back later (InferenceMode,
// the autograd engine's guard around each node, a generator suspended inside such a guard) can
// put the key back on after its region closed. Such a stale key heals itself: an op that
// reaches the fallback with no region of this route open takes the key off its thread; a
// region opening on a thread that has it treats it as its own; and after the fallback is
// taken out, an inert fallthrough stays at the key (a tombstone), so that a thread that still
// has it runs its ops as if it had not.
c10::RegistrationHandleRAII* key_fallback = nullptr;
c10::RegistrationHandleRAII* key_tombstone = nullptr;
// The route the open region follows ops by (1: this fallback); see mn_begin.
int route = 0;

// lift_fresh's schema: the op `torch.tensor(...)` and `torch.as_tensor(...)` hand their new
// data to. Its input is not read (as a dispatch mode's accounting does not): the data is the
// region's new memory, counted as the op's output.
const c10::FunctionSchema* lift_fresh = nullptr;

void mode_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t n_in = &op.schema() == lift_fresh ? 0 : op.schema().arguments().size();
  uint64_t mine = 0;
  bool queue = false;
  {
    std::lock_guard<std::mutex> g(mu);
    mine = route == 1 ? region : 0;
    if (mine == 0) {  // a stale key (see above): off this thread from now on
      key_off();
    } else if (watching()) {
      look_at_adopted();
    }
    if (mine != 0 && n_in <= stack->size()) {
      for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n_in); it != stack->end(); ++it) {
        each_tensor(*it, read_storage);
        if (keep) {
          leaves_of_inputs(*it);
        }
      }
      if (keep) {
        auto node = torch::autograd::get_current_node();
        op_phase = node != nullptr ? kBackward : static_cast<int8_t>(mn_py_phase);
        queue = backward_begins(node.get());
      }
    }
  }
  if (queue) {
    queue_after_backward();
  }
  {
    struct PhaseReset {  // (also when the op raises)
      ~PhaseReset() { op_phase = -1; }
    } reset;
    c10::impl::ExcludeDispatchKeyGuard guard(kModeKey);
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kModeKey), stack);
  }
  if (mine == 0) {
    return;
  }
  const size_t n_out = op.schema().returns().size();
  std::lock_guard<std::mutex> g(mu);
  if (region != mine || n_out > stack->size()) {
    return;
  }
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n_out); it != stack->end(); ++it) {
    each_tensor(*it, returned_storage);
  }
}

// 0: the fallback is registered (now or before); 1: the key has a fallback or kernels of
// PyTorch's own (the RecordFunction route is used).
int register_key_fallback() {
  if (key_fallback != nullptr) {
    return 0;
  }
  auto& d = c10::Dispatcher::singleton();
  if (!d.getRegistrationsForDispatchKey(kModeKey).empty()) {
    return 1;  // PyTorch's own kernels at that key: ours would not see those ops
  }
  delete key_tombstone;  // ours, from an earlier uninstall
  key_tombstone = nullptr;
  if (lift_fresh == nullptr) {
    auto handle = d.findSchema({"aten::lift_fresh", ""});
    if (handle.has_value()) {
      lift_fresh = &handle->schema();
    }
  }
  try {
    key_fallback = new c10::RegistrationHandleRAII(d.registerFallback(
        kModeKey, c10::KernelFunction::makeFromBoxedFunction<&mode_fallback>(), "memlab"));
  } catch (...) {
    return 1;  // a fallback of PyTorch's own
  }
  return 0;
}

void unregister_key_fallback() {
  if (key_fallback == nullptr) {
    return;
  }
  delete key_fallback;  // its destructor takes the fallback out
  key_fallback = nullptr;
  try {
    key_tombstone = new c10::RegistrationHandleRAII(c10::Dispatcher::singleton().registerFallback(
        kModeKey, c10::KernelFunction::makeFallthrough(), "memlab (inert)"));
  } catch (...) {
    key_tombstone = nullptr;
  }
}
#endif

bool prefer_records = false;  // tests: the RecordFunction route even where the key is free

void report(c10::StorageImpl* s) {
  hold(reported, s);
}

void forget_reported() {
  for (c10::StorageImpl* s : reported) {
    to_release.push_back(s);
  }
  reported.clear();
  for (auto& kv : sticky) {
    to_release.push_back(kv.first);
  }
  sticky.clear();
}

// The pointer a weakly held entry of a set, or of a map by its key, is about.
template <class P>
P* key_of(P* p) {
  return p;
}
template <class P, class V>
P* key_of(const std::pair<P* const, V>& kv) {
  return kv.first;
}

// Takes the entries whose object died out of `c` (a set, or a map by its key), their weak
// references into `release` (let go outside the lock).
template <class C, class P>
void drop_dead(C& c, std::vector<P*>& release) {
  for (auto it = c.begin(); it != c.end();) {
    P* p = key_of(*it);
    if (c10::raw::weak_intrusive_ptr::use_count(p) == 0) {
      release.push_back(p);
      it = c.erase(it);
    } else {
      ++it;
    }
  }
}

void prune_reported() {
  if (reported.size() < prune_at) {
    return;
  }
  drop_dead(reported, to_release);
  drop_dead(sticky, to_release);
  prune_at = 2 * reported.size() + 4096;
}

void prune_plain() {
  if (plain.size() < plain_prune_at) {
    return;
  }
  drop_dead(plain, to_release_impls);
  plain_prune_at = 2 * plain.size() + 4096;
}

// An allocation whose block was freed while its storage lives on, in memory that is not a
// block of this region followed by it: the storage's memory moved out of the wrapper's
// (share_memory_ puts it in a shared segment). It keeps its bytes, as the ledger sees it.
// Under `mu`.
bool moved_out(const Alloc& a) {
  if (a.free_seq < 0 || a.storage == nullptr || a.superseded ||
      c10::raw::weak_intrusive_ptr::use_count(a.storage) == 0) {
    return false;
  }
  const auto now = reinterpret_cast<uintptr_t>(a.storage->data_ptr().get());
  if (now == 0) {
    return false;
  }
  auto it = live.find(now);
  // (`regions`: the open region's number, or the last one's once it closed)
  return it == live.end() || it->second.region != regions || it->second.index < 0 ||
         allocs[it->second.index].storage != a.storage;
}

// An allocation whose storage is alive at the region's end, in this block or moved out.
bool survives(const Alloc& a) {
  return a.storage != nullptr && (a.free_seq < 0 || moved_out(a));
}

// Empties a container that holds something (an unordered one's clear() zeroes its whole
// bucket array, as large as the largest region made it, even where it holds nothing).
template <class C>
void empty_out(C& c) {
  if (!c.empty()) {
    c.clear();
  }
}

// A map from an address (a storage's, or a block's) to a pair of numbers, for mn_tally's one
// pass: open addressing in arrays kept from call to call, so that the pass allocates nothing
// per entry (a node-based map allocates each). `reset` sizes it for about n keys; it grows
// where more come.
class AddressMap {
 public:
  struct Slot {
    uintptr_t key;
    int64_t a;
    int32_t b;
  };
  void reset(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 2) {
      cap <<= 1;
    }
    if (slots_.size() < cap) {
      slots_.assign(cap, Slot{kEmpty, 0, 0});
    } else {  // (only the part it uses: an earlier, larger region's arrays stay allocated)
      std::fill(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(cap), Slot{kEmpty, 0, 0});
    }
    mask_ = cap - 1;
    size_ = 0;
  }
  // The slot of `key`, or null.
  Slot* find(uintptr_t key) {
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) {
        return &s;
      }
      if (s.key == kEmpty) {
        return nullptr;
      }
    }
  }
  // The slot of `key`, made (a = 0, b = -1) where it is new; `made` says which.
  Slot& get(uintptr_t key, bool& made) {
    if (2 * (size_ + 1) > mask_ + 1) {
      grow();
    }
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) {
        made = false;
        return s;
      }
      if (s.key == kEmpty) {
        s = Slot{key, 0, -1};
        ++size_;
        made = true;
        return s;
      }
    }
  }
  // Takes `key` out (backward-shift deletion: no tombstones).
  void erase(Slot* s) {
    size_t i = static_cast<size_t>(s - slots_.data());
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (slots_[j].key == kEmpty) {
        break;
      }
      const size_t home = hash(slots_[j].key) & mask_;
      // move j back to i where i lies cyclically in [home, j)
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = kEmpty;
    --size_;
  }
  template <class F>
  void each(F f) {  // (every live slot, in the arrays' order)
    for (size_t i = 0; i <= mask_; ++i) {
      if (slots_[i].key != kEmpty) {
        f(slots_[i]);
      }
    }
  }

 private:
  static constexpr uintptr_t kEmpty = ~static_cast<uintptr_t>(0);  // (no address is all ones)
  static size_t hash(uintptr_t key) {
    return static_cast<size_t>((key >> 4) * 0x9E3779B97F4A7C15ull >> 16);
  }
  void grow() {
    std::vector<Slot> old(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(mask_ + 1));
    reset(mask_ + 1);
    for (const Slot& s : old) {
      if (s.key != kEmpty) {
        bool made = false;
        get(s.key, made) = s;
      }
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

void drop_weak_refs() {
  for (Alloc& a : allocs) {
    if (a.storage != nullptr) {
      to_release.push_back(a.storage);
      a.storage = nullptr;
    }
  }
  for (Read& r : reads) {
    to_release.push_back(r.storage);
  }
  for (c10::StorageImpl* s : read_seen) {
    to_release.push_back(s);
  }
  empty_out(allocs);
  empty_out(earlier_frees);
  empty_out(reads);
  empty_out(read_seen);
  empty_out(read_index);
  empty_out(reported_reads);
  empty_out(moves);
  empty_out(adopted_alive);
  empty_out(older_by_ptr);
  empty_out(swapped_older);
  empty_out(current);
  empty_out(resizes);
  for (auto& kv : marks) {
    to_release.push_back(kv.first);
  }
  for (c10::StorageImpl* s : save_keys) {
    to_release.push_back(s);
  }
  for (c10::StorageImpl* s : resize_keys) {
    to_release.push_back(s);
  }
  empty_out(resize_keys);
  for (c10::TensorImpl* t : leaves) {
    to_release_impls.push_back(t);
  }
  for (auto& kv : older) {
    if (kv.second.reader != nullptr) {
      to_release_impls.push_back(kv.second.reader);
    }
  }
  empty_out(fresh_older);
  empty_out(marks);
  empty_out(save_keys);
  empty_out(leaves);
  empty_out(saves);
  empty_out(older);
  empty_out(adopted_keys);
  aliases.clear();  // (those alive were handed to the ledger; each still logs when it goes)
  empty_out(older_order);
  empty_out(ev_ns);
  empty_out(ev_phase);
  queued_tasks.clear();
  empty_out(walked);
  marked = 0;
  seq = 0;
}

}  // namespace

extern "C" {

int mn_version() {
  return 8;
}

#ifndef MN_MODE_KEY
int route = 0;  // the route of the open region (or the last): always RecordFunction here
#endif

// The route the last region was recorded by: 1 the dispatch key's fallback, 0 RecordFunction.
int mn_route() {
  return route;
}

// Tests: 1 records regions by RecordFunction even where the dispatch key is free.
void mn_prefer_records(int yes) {
  std::lock_guard<std::mutex> g(mu);
  prefer_records = yes != 0;
}

// The wrapper in place of PyTorch's CPU allocator, once (see the top). Under `mu`. 0: in;
// 2: other code replaced it since (not ours to take back).
int install_locked() {
  if (!installed) {
    // `original` first: another thread may allocate through the wrapper the moment it is in
    // (%load_ext puts it in from the build's thread while the notebook runs)
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != &wrapper) {  // (ours put back by other code: the one it wraps stays)
      original = current;
    }
    if (original == nullptr) {
      return 2;
    }
    c10::SetCPUAllocator(&wrapper, 0);
    if (c10::GetCPUAllocator() != &wrapper) {
      return 2;
    }
    installed = true;
  } else if (c10::GetCPUAllocator() != &wrapper) {
    return 2;
  }
  return 0;
}

// Opens a region on the calling thread, for the ledger whose identity is `ledger`. 0: open;
// 1: another region is open (or its record is not yet released); 2: PyTorch's CPU allocator
// could not be replaced (a higher-priority allocator is set); 3: failed otherwise.
int begin_locked(int64_t max_events, int64_t ledger, int keep_events) {
  try {
    std::lock_guard<std::mutex> g(mu);
    if (region != 0 || held) {
      return 1;  // a region is open, or its record not yet read
    }
#ifndef MN_LOAD_PYOBJ
    if (keep_events != 0) {
      return 5;  // no breakdown here: its saved aliases could not be handed to the ledger
    }
#endif
    if (!at::isRecordFunctionEnabled()) {
      return 3;
    }
    const int in = install_locked();
    if (in != 0) {
      return in;
    }
    drop_weak_refs();
    if (ledger != reported_to) {  // another ledger: it knows none of the storages reported
      forget_reported();
      reported_to = ledger;
    }
    prune_reported();
    prune_plain();
    limit = max_events > 0 ? max_events : limit;
    keep = keep_events != 0;
    overflow = false;
    transformed = false;
    seq = 0;
    marked = 0;
    region = ++regions;
    followed_region = region;
    foreign_blocks = foreign_bytes = 0;
    held = true;
    running.clear();  // records left open by an earlier region that closed inside an op
    route = 0;
#ifdef MN_MODE_KEY
    // (the key already on this thread: a stale one of ours, put back by code that restored
    // the thread's keys; nothing else uses it)
    if (!prefer_records && register_key_fallback() == 0) {
      c10::impl::tls_set_dispatch_key_included(kModeKey, true);
      key_included = true;
      route = 1;
      return 0;
    }
    if (c10::impl::tls_is_dispatch_key_included(kModeKey)) {  // stale: off for this route
      key_off();
    }
#endif
    handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_start, &on_end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION}));
    return 0;
  } catch (...) {
    region = 0;
    held = false;  // (else every later region would find the record held)
    return 3;
  }
}

int mn_begin(int64_t max_events, int64_t ledger, int keep_events) {
  const int code = begin_locked(max_events, ledger, keep_events);
  release_deferred();
  return code;
}

// The wrapper in now, before any region (`%load_ext memlab`): the blocks a notebook allocates
// before its first tracked cell are followed, so that a region that frees them places each free
// in time. As install_locked.
int mn_install() {
  std::lock_guard<std::mutex> g(mu);
  return install_locked();
}

// A thread started while the region is open joins it (memlab/core/native/joiner.py): the key
// route's key on the calling thread too, so the record follows its ops. Where it outlives the
// region, its next op takes the key off again (see mode_fallback). 1: joined; 0: no region
// open on the key route (a thread of the RecordFunction route is not followed).
int mn_thread_join() {
#ifdef MN_MODE_KEY
  std::lock_guard<std::mutex> g(mu);
  if (region == 0 || route != 1) {
    return 0;
  }
  c10::impl::tls_set_dispatch_key_included(kModeKey, true);
  key_included = true;
  followed_region = region;
  return 1;
#else
  return 0;
#endif
}

// Closes the region: no more events are logged. Its record stays readable until the next one.
void mn_end() {
  if (handle != 0) {
    at::removeCallback(handle);
    handle = 0;
  }
#ifdef MN_MODE_KEY
  // called on the region's thread, where it was included (or put back by a guard since)
  if (key_included || c10::impl::tls_is_dispatch_key_included(kModeKey)) {
    key_off();
  }
#endif
  std::lock_guard<std::mutex> g(mu);
  if (watching()) {
    look_at_adopted();
  }
  if (keep) {
    mark_grads();  // the gradients alive now
  }
  for (const Alloc& a : allocs) {  // alive, and no op returned it: not the ledger's
    if (a.storage == nullptr && a.free_seq < 0) {
      ++unfollowed;
      foreign_blocks += a.foreign ? 1 : 0;
      foreign_bytes += a.foreign ? a.size : 0;
    }
  }
  region = 0;
}

// `unfollowed` (above), for the namespace's watch.
int64_t mn_unfollowed() {
  std::lock_guard<std::mutex> g(mu);
  return unfollowed;
}

// [blocks, bytes] another thread allocated in the last region, alive at its end (see
// `foreign_blocks`).
void mn_foreign(int64_t* out) {
  std::lock_guard<std::mutex> g(mu);
  out[0] = foreign_blocks;
  out[1] = foreign_bytes;
}

// Counts: [allocations logged, of them returned by an op, earlier blocks freed, storages read,
// 1 if events were dropped, allocations returned by an op and still alive, 1 if the
// RecordFunction route saw a torch.func transform].
void mn_counts(int64_t* out, int64_t n) {  // writes the first n (at most 7)
  std::lock_guard<std::mutex> g(mu);
  int64_t alive = 0;
  for (const Alloc& a : allocs) {
    alive += survives(a) ? 1 : 0;
  }
  const int64_t all[7] = {static_cast<int64_t>(allocs.size()),
                          marked,
                          static_cast<int64_t>(earlier_frees.size()),
                          static_cast<int64_t>(reads.size()),
                          overflow ? 1 : 0,
                          alive,
                          transformed ? 1 : 0};
  for (int64_t i = 0; i < n && i < 7; ++i) {
    out[i] = all[i];
  }
}

// The region's figures over the accounting's allocations, plus the frees of earlier blocks at
// `known` (addresses of storages the ledger followed that died in the region; n of them), of
// the old blocks of older storages an op moved, and of adopted ones (see Alloc).
// out (n_out of): [highest running total above the start, total at the end, known frees found
// in the log, bytes of known or moved frees not found (counted at the end), bytes of adopted
// storages freed where the record could not place it (counted to the end)].
void mn_sweep(const uintptr_t* known, int64_t n, const int64_t* known_sizes, int64_t* out,
              int64_t n_out) {
  std::lock_guard<std::mutex> g(mu);
  std::unordered_map<uintptr_t, int64_t> wanted;
  wanted.reserve(static_cast<size_t>(n) + moves.size());
  for (int64_t i = 0; i < n; ++i) {
    wanted[known[i]] = known_sizes[i];
  }
  std::unordered_map<uintptr_t, int64_t> adopted;  // address -> bytes
  // Deltas by sequence number: each event has its own; a resize's goes before the event that
  // followed it.
  std::vector<int64_t> delta(static_cast<size_t>(seq) + 1, 0);
  for (const Resize& r : resizes) {
    delta[r.seq] += r.added;
  }
  int64_t found = 0;
  for (const Move& m : moves) {
    delta[m.seq] -= m.size;
    found += wanted.erase(m.old_ptr) != 0 ? 1 : 0;  // its old bytes left here already
  }
  for (const Alloc& a : allocs) {
    if (a.storage == nullptr) {
      continue;
    }
    delta[a.seq] += a.size;
    if (a.free_seq >= 0 && !a.superseded && !moved_out(a)) {
      delta[a.free_seq] -= a.size;
    }
    if (a.older_block) {
      adopted.emplace(a.ptr, a.size);
    }
  }
  for (const Freed& f : earlier_frees) {
    auto it = wanted.find(f.ptr);
    if (it != wanted.end()) {
      delta[f.seq] -= it->second;
      wanted.erase(it);
      ++found;
      continue;
    }
    auto ad = adopted.find(f.ptr);
    if (ad != adopted.end()) {  // an older block of the wrapper's an op handed back: freed here
      delta[f.seq] -= ad->second;
      adopted.erase(ad);
    }
  }
  int64_t running = 0, high = 0;
  for (int64_t d : delta) {
    running += d;
    if (running > high) {
      high = running;
    }
  }
  int64_t missing = 0;
  for (const auto& kv : wanted) {
    missing += kv.second;
  }
  int64_t unplaced = 0;
  for (const Alloc& a : allocs) {
    if (a.adopted && !a.older_block && a.free_seq < 0 &&
        c10::raw::weak_intrusive_ptr::use_count(a.storage) == 0) {
      unplaced += a.size;  // dead, its free never seen (not the wrapper's memory)
    }
  }
  const int64_t all[5] = {high, running - missing, found, missing, unplaced};
  for (int64_t i = 0; i < n_out && i < 5; ++i) {
    out[i] = all[i];
  }
}

// The accounting's allocations still alive: a new weak reference to each storage (for
// torch.UntypedStorage._new_with_weak_ptr; the caller frees it) and its size. Returns how many
// were written (at most cap).
int64_t mn_survivors(intptr_t* storages, int64_t* sizes, int64_t cap) {
  std::lock_guard<std::mutex> g(mu);
  int64_t k = 0;
  for (const Alloc& a : allocs) {
    if (k >= cap) {
      break;
    }
    if (survives(a)) {
      c10::raw::weak_intrusive_ptr::incref(a.storage);
      report(a.storage);
      storages[k] = reinterpret_cast<intptr_t>(a.storage);
      sizes[k] = a.size;
      ++k;
    }
  }
  return k;
}

// The storages the region read that predate it: a new weak reference to each, its address and
// size when first read. Returns how many were written (at most cap).
int64_t mn_reads(intptr_t* storages, uintptr_t* ptrs, int64_t* sizes, int64_t cap) {
  std::lock_guard<std::mutex> g(mu);
  int64_t k = 0;
  for (const Read& r : reads) {
    if (k >= cap) {
      break;
    }
    if (r.taken) {
      continue;
    }
    c10::raw::weak_intrusive_ptr::incref(r.storage);
    report(r.storage);
    storages[k] = reinterpret_cast<intptr_t>(r.storage);
    ptrs[k] = r.ptr;
    sizes[k] = r.size;
    ++k;
  }
  return k;
}

// A storage was resized in place (UntypedStorage.resize_, outside the dispatcher): its memory
// moved from the block at old_ptr to the one at new_ptr. Returns 1 where the storage is one an
// op returned in this region (it follows its new block; the ledger learns it at the end), else
// 0: its change of size, `added`, is placed here in the order, and its new block is never
// counted as an op's (the ledger follows the storage).
int mn_resized(uintptr_t old_ptr, uintptr_t new_ptr, int64_t added, intptr_t storage) {
  std::lock_guard<std::mutex> g(mu);
  if (region == 0) {
    return 0;
  }
  c10::StorageImpl* owner = nullptr;
  Alloc* before = nullptr;
  for (auto it = allocs.rbegin(); it != allocs.rend(); ++it) {
    if (it->ptr == old_ptr && it->storage != nullptr) {
      owner = it->storage;
      before = &*it;
      break;
    }
  }
  auto nb = live.find(new_ptr);
  Alloc* fresh = nullptr;
  if (nb != live.end() && nb->second.region == region && nb->second.index >= 0) {
    fresh = &allocs[nb->second.index];
  }
  if (owner != nullptr && old_ptr != 0) {
    if (fresh != nullptr && fresh->storage == nullptr) {
      c10::raw::weak_intrusive_ptr::incref(owner);
      fresh->storage = owner;
      ++marked;
      // as the dispatch mode's ledger sees a resize: the old bytes leave as the new arrive
      moves.push_back({fresh->seq, before->size, old_ptr, owner});
      before->superseded = true;
      current[owner] = static_cast<size_t>(nb->second.index);
    }
    return 1;
  }
  auto* st = reinterpret_cast<c10::StorageImpl*>(storage);
  if (keep && st != nullptr && is_cpu(st)) {  // the ledger's storage: its role is the ledger's
    hold(resize_keys, st);
    if (older.count(st) == 0) {  // met now, at its size before
      older.emplace(st, Older{old_ptr, static_cast<int64_t>(st->nbytes()) - added, false});
    }
  } else {
    st = nullptr;
  }
  resizes.push_back({seq, added, st});
  if (fresh != nullptr) {
    nb->second.region = 0;  // the ledger's storage, not a new one: never marked
    nb->second.index = -1;
  }
  return 0;
}

// Drops the record of the last region (its weak references keep storage objects, not their
// memory) once it has been read.
void mn_release() {
  {
    std::lock_guard<std::mutex> g(mu);
    if (region != 0) {
      return;
    }
    held = false;
    drop_weak_refs();
    if (allocs.capacity() > 65536) {
      std::vector<Alloc>().swap(allocs);  // NOLINT
      std::vector<Freed>().swap(earlier_frees);
    }
  }
  release_deferred();
}

// Whether the block at ptr was allocated through the wrapper and is alive.
int mn_follows(uintptr_t ptr) {
  std::lock_guard<std::mutex> g(mu);
  return live.count(ptr) != 0 ? 1 : 0;
}

// Puts PyTorch's CPU allocator back (where the wrapper is still the one in place) and drops the
// last record. 0: done or nothing to do; 1: a region is open; 2: other code replaced it since.
// keep_key: the dispatch key's fallback stays registered (inert while no region includes the
// key; registering it again costs a millisecond or two: the benchmarks' untracked anchor).
int uninstall_locked(int keep_key) {
  std::lock_guard<std::mutex> g(mu);
  if (region != 0 || held) {
    return 1;
  }
  drop_weak_refs();
  if (keep_key == 0) {  // (kept for the benchmarks' anchor: the ledger is the same after it)
    forget_reported();
  }
#ifdef MN_MODE_KEY
  if (keep_key == 0) {
    unregister_key_fallback();
  }
#endif
  if (!installed) {
    return 0;
  }
  if (c10::GetCPUAllocator() != &wrapper) {
    return 2;
  }
  c10::SetCPUAllocator(original, 0);
  installed = false;
  return 0;
}

int mn_uninstall(int keep_key) {
  const int code = uninstall_locked(keep_key);
  release_deferred();
  return code;
}

// ---- the breakdown's exports -----------------------------------------------------------------

// Registers memlab::saved, the op memlab's saved-tensor hook calls: 0 done (now or before).
int mn_saved_op() {
  std::lock_guard<std::mutex> g(mu);
  return register_saved_op();
}

// The op's kernel, for the pack hook written in C (pack.cpp): `out` gets what memlab::saved
// would return for `in`. It throws where the op would (a subclass's detach() that raises).
int mn_save_into(const at::Tensor* in, at::Tensor* out) {
  *out = saved_kernel(*in);
  return 0;
}

// The open region's storage (a torch.UntypedStorage's _cdata) plays role `code` (see marks).
// Also after mn_end, until the record is released: the roles read at the region's end.
void mn_mark(intptr_t storage, int code) {
  std::lock_guard<std::mutex> g(mu);
  if (held && keep && storage != 0) {
    mark_storage(reinterpret_cast<c10::StorageImpl*>(storage), code);
  }
}

// A storage from before the region that the ledger counted as saved for backward (a graph
// from an earlier cell, walked by memlab.core.older_graphs), found released now: logged as the
// end of an older alias's saving is. Only while the region is open, with a breakdown.
void mn_unsaved(intptr_t storage) {
  std::lock_guard<std::mutex> g(mu);
  if (region != 0 && keep && storage != 0) {
    saved_event(reinterpret_cast<c10::StorageImpl*>(storage), -1);
  }
}

// The roles given in the region: a new weak reference to each storage, and its code. Returns
// how many were written (at most cap).
int64_t mn_marks(intptr_t* storages, int64_t* codes, int64_t cap) {
  std::lock_guard<std::mutex> g(mu);
  int64_t k = 0;
  for (const auto& kv : marks) {
    if (k >= cap) {
      break;
    }
    if (c10::raw::weak_intrusive_ptr::use_count(kv.first) == 0) {
      continue;  // (the ledger only keeps the roles of the living)
    }
    c10::raw::weak_intrusive_ptr::incref(kv.first);
    storages[k] = reinterpret_cast<intptr_t>(kv.first);
    codes[k] = kv.second;
    ++k;
  }
  return k;
}

int64_t mn_marks_count() {  // of the living
  std::lock_guard<std::mutex> g(mu);
  int64_t n = 0;
  for (const auto& kv : marks) {
    n += c10::raw::weak_intrusive_ptr::use_count(kv.first) > 0 ? 1 : 0;
  }
  return n;
}

// The storages from before the region that it touched (see Older): a new weak reference to
// each, its address and size when first met, whether an op read it, and the role it was given
// here (0 none). Their order is the one `mn_tally` takes their roles in. Returns how many.
int64_t mn_older(intptr_t* storages, uintptr_t* ptrs, int64_t* sizes, int64_t* read, int64_t* code,
                 int64_t cap) {
  std::lock_guard<std::mutex> g(mu);
  older_order.clear();
  std::unordered_set<c10::StorageImpl*> moved;
  for (const Move& m : moves) {
    moved.insert(m.storage);
  }
  int64_t k = 0;
  for (const auto& kv : older) {
    if (k >= cap) {
      break;
    }
    auto st = sticky.find(kv.first);
    if (st != sticky.end() && c10::raw::weak_intrusive_ptr::use_count(kv.first) > 0 &&
        moved.count(kv.first) == 0 && resize_keys.count(kv.first) == 0) {
      auto m = marks.find(kv.first);
      if (m == marks.end() || m->second >= st->second) {
        continue;  // its lasting role all through: summed from the ledger
      }
    }
    c10::raw::weak_intrusive_ptr::incref(kv.first);
    storages[k] = reinterpret_cast<intptr_t>(kv.first);
    ptrs[k] = kv.second.ptr;
    sizes[k] = kv.second.size;
    read[k] = kv.second.read ? 1 : 0;
    auto m = marks.find(kv.first);
    code[k] = m != marks.end() ? m->second : 0;
    older_order.push_back(kv.first);
    ++k;
  }
  return k;
}

// The ledger holds this storage (a _cdata) with the lasting role `code` (see `sticky`).
void mn_sticky(intptr_t storage, int code) {
  std::lock_guard<std::mutex> g(mu);
  auto* s = reinterpret_cast<c10::StorageImpl*>(storage);
  if (s == nullptr || code <= 0) {
    return;
  }
  keep_stronger(sticky, s, code);
}

int64_t mn_older_count() {
  std::lock_guard<std::mutex> g(mu);
  return static_cast<int64_t>(older.size());
}

#ifdef MN_LOAD_PYOBJ
// The Python objects of this region's saved aliases still alive (autograd holds them), handed
// out once (a settling done again after a Ctrl-C does not count them twice). Called with the
// GIL held (through ctypes.PyDLL), so none can die before the caller takes them.
int64_t mn_aliases(intptr_t* objects, int64_t cap) {
  std::lock_guard<std::mutex> g(mu);
  int64_t k = 0;
  for (auto it = aliases.begin(); it != aliases.end() && k < cap;) {
    PyObject* obj = (*it)->pyobj_slot()->load_pyobj();
    if (obj != nullptr) {  // a new reference, which the caller gives up once it holds its own
      (*c10::impl::getGlobalPyInterpreter())->incref(obj);
      objects[k++] = reinterpret_cast<intptr_t>(obj);
    }
    it = aliases.erase(it);
  }
  return k;
}
#else
int64_t mn_aliases(intptr_t*, int64_t) {
  return 0;
}
#endif

namespace {
// A leaf, or a tensor an older storage was first read through, whose type Python is asked
// for: alive, with a storage that has no lasting role yet (named before: the ledger holds it).
bool untyped(c10::TensorImpl* impl) {  // under `mu`
  return c10::raw::weak_intrusive_ptr::use_count(impl) != 0 && impl->has_storage() &&
         sticky.count(impl->unsafe_storage().unsafeGetStorageImpl()) == 0 &&
         plain.count(impl) == 0;
}
}  // namespace

// A tensor mn_typed handed out (its TensorImpl: a tensor's _cdata) is no parameter.
void mn_plain(intptr_t tensor) {
  std::lock_guard<std::mutex> g(mu);
  auto* impl = reinterpret_cast<c10::TensorImpl*>(tensor);
  if (impl != nullptr && plain.insert(impl).second) {
    c10::raw::weak_intrusive_ptr::incref(impl);
  }
}

#ifdef MN_LOAD_PYOBJ
// The Python objects of the leaves and of the tensors older storages were first read through,
// whose storage has no lasting role yet (alive, with a Python object): only Python can tell a
// parameter (a frozen one included) by its type. GIL held (ctypes.PyDLL), as for mn_aliases.
int64_t mn_typed(intptr_t* objects, int64_t cap) {
  std::lock_guard<std::mutex> g(mu);
  int64_t k = 0;
  auto add = [&](c10::TensorImpl* impl) {
    if (k >= cap || !untyped(impl)) {
      return;
    }
    PyObject* obj = impl->pyobj_slot()->load_pyobj();
    if (obj != nullptr) {  // a new reference (see mn_aliases)
      (*c10::impl::getGlobalPyInterpreter())->incref(obj);
      objects[k++] = reinterpret_cast<intptr_t>(obj);
    }
  };
  for (c10::TensorImpl* impl : leaves) {
    add(impl);
  }
  for (const auto& kv : older) {
    if (kv.second.reader != nullptr && marks.count(kv.first) == 0) {
      add(kv.second.reader);
    }
  }
  return k;
}
#else
int64_t mn_typed(intptr_t*, int64_t) {
  return 0;
}
#endif

// How many mn_typed may hand out (at most): none once every leaf and reader has its role.
int64_t mn_typed_count() {
  std::lock_guard<std::mutex> g(mu);
  int64_t n = 0;
  for (c10::TensorImpl* impl : leaves) {
    n += untyped(impl) ? 1 : 0;
  }
  for (const auto& kv : older) {
    const bool read_by = kv.second.reader != nullptr && marks.count(kv.first) == 0;
    n += read_by && untyped(kv.second.reader) ? 1 : 0;
  }
  return n;
}

// The gradients of the leaves met so far, named now (an optimizer steps: one stepped inside
// backward frees them before the backward ends).
void mn_mark_grads() {
  std::lock_guard<std::mutex> g(mu);
  if (held && keep) {
    mark_grads();
  }
}

int64_t mn_alias_count() {
  std::lock_guard<std::mutex> g(mu);
  return static_cast<int64_t>(aliases.size());
}

namespace {
constexpr int kCats = 12;  // codes 1..12 (memlab.core.categories.PRIORITY + 1)
constexpr int kActivation = 9, kTemporary = 10, kOther = 11, kInput = 8;

struct Ent {
  int64_t size = 0;
  int code = 0;     // its lasting role (0 none)
  int saved = 0;    // how many saved aliases hold it now
  bool predates = false;
  bool freed = false;  // new in the region, and dead at its end
  int role() const {
    if (code != 0) {
      return code;
    }
    if (saved > 0) {
      return kActivation;
    }
    return (predates || !freed) ? kOther : kTemporary;
  }
};

struct Ev {
  int64_t seq;
  int32_t ent;
  int32_t kind;  // 0 bytes, 1 saved +-1
  int64_t delta;
};

std::vector<int64_t>& pt_total = *new std::vector<int64_t>();
std::vector<double>& pt_secs = *new std::vector<double>();
std::vector<int8_t>& pt_phase = *new std::vector<int8_t>();

// mn_tally's containers, kept (under `mu`): its entries, events, and four maps.
std::vector<Ent>& t_ents = *new std::vector<Ent>();
std::vector<Ev>& t_evs = *new std::vector<Ev>();
AddressMap& t_by_storage = *new AddressMap();  // storage -> (_, entry)
AddressMap& t_by_ptr = *new AddressMap();      // block of a storage from before -> (_, entry)
AddressMap& t_wanted = *new AddressMap();      // known free's address -> (bytes, code)
AddressMap& t_adopted = *new AddressMap();     // older block adopted -> (bytes, entry)
}  // namespace

// The region's figures and its categories (a breakdown): mn_sweep's events, each one's bytes
// given to a storage, replayed in order with each storage's role. `known` as for mn_sweep,
// with `known_codes` the role each of those storages had when freed; `codes` and `saved_end`
// the roles and saved counts at the end of the storages `mn_older` handed out (in its order).
// out (n_out of): mn_sweep's five figures. cats: 3 x 12 (at the peak, at the end, the highest
// each reached), by code - 1, above nothing (the caller adds what the region never touched).
// Returns the number of timeline points (one per event with bytes); mn_points hands them out.
int64_t mn_tally(const uintptr_t* known, int64_t n, const int64_t* known_sizes,
                 const int64_t* known_codes, const int64_t* codes, const int64_t* saved_end,
                 int64_t n_older, int64_t t0_ns, int64_t* out, int64_t n_out, int64_t* cats) {
  std::lock_guard<std::mutex> g(mu);
  std::vector<Ent>& ents = t_ents;
  ents.clear();
  const size_t most = allocs.size() + saves.size() + older_order.size() + moves.size() + 1;
  ents.reserve(most + static_cast<size_t>(n));
  AddressMap& by_storage = t_by_storage;
  by_storage.reset(most);
  AddressMap& by_ptr = t_by_ptr;  // storages from before, by block
  by_ptr.reset(older_order.size() + static_cast<size_t>(n));
  auto ent_of = [&](c10::StorageImpl* s) -> int32_t {
    bool made = false;
    AddressMap::Slot& slot = by_storage.get(reinterpret_cast<uintptr_t>(s), made);
    if (made) {
      slot.b = static_cast<int32_t>(ents.size());
      ents.emplace_back();
    }
    return slot.b;
  };
  // the storages from before, with the roles the caller read from the ledger
  const int64_t given = std::min<int64_t>(n_older, static_cast<int64_t>(older_order.size()));
  for (int64_t i = 0; i < given; ++i) {
    c10::StorageImpl* s = older_order[i];
    const int32_t e = ent_of(s);
    const Older& o = older[s];
    Ent& x = ents[e];
    x.predates = true;
    x.size = o.size;
    x.code = static_cast<int>(codes[i]);
    x.saved = static_cast<int>(saved_end[i]);
    bool made = false;
    AddressMap::Slot& slot = by_ptr.get(o.ptr, made);
    if (made) {
      slot.b = e;
    }
  }
  AddressMap& wanted = t_wanted;  // address -> (bytes, code)
  wanted.reset(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    bool made = false;
    AddressMap::Slot& slot = wanted.get(known[i], made);
    slot.a = known_sizes[i];
    slot.b = static_cast<int32_t>(known_codes[i]);
  }
  auto ent_of_ptr = [&](uintptr_t ptr, int64_t size, int code) -> int32_t {
    if (AddressMap::Slot* it = by_ptr.find(ptr)) {
      Ent& x = ents[it->b];
      if (x.code == 0 || (code != 0 && code < x.code)) {
        x.code = code != 0 ? code : x.code;
      }
      return it->b;
    }
    const auto e = static_cast<int32_t>(ents.size());
    ents.emplace_back();
    ents[e].predates = true;
    ents[e].size = size;
    ents[e].code = code;
    bool made = false;
    by_ptr.get(ptr, made).b = e;
    return e;
  };
  std::vector<Ev>& evs = t_evs;
  evs.clear();
  evs.reserve(allocs.size() * 2 + saves.size() + earlier_frees.size());
  int32_t resized_ent = -1;  // bytes of storages resized in place with no storage known
  for (const Resize& r : resizes) {
    if (r.storage != nullptr && older.count(r.storage) != 0) {
      evs.push_back({r.seq, ent_of(r.storage), 0, r.added});
      continue;
    }
    if (resized_ent < 0) {
      resized_ent = static_cast<int32_t>(ents.size());
      ents.emplace_back();
      ents[resized_ent].predates = true;
    }
    evs.push_back({r.seq, resized_ent, 0, r.added});
  }
  int64_t found = 0;
  for (const Move& m : moves) {
    AddressMap::Slot* w = wanted.find(m.old_ptr);
    const int32_t e = ent_of(m.storage);
    if (w != nullptr) {
      ++found;
      wanted.erase(w);
    }
    evs.push_back({m.seq, e, 0, -m.size});
  }
  AddressMap& adopted = t_adopted;  // address -> bytes, entry
  adopted.reset(0);
  for (const Alloc& a : allocs) {
    if (a.storage == nullptr) {
      continue;
    }
    const int32_t e = ent_of(a.storage);
    evs.push_back({a.seq, e, 0, a.size});
    if (a.free_seq >= 0 && !a.superseded && !moved_out(a)) {
      evs.push_back({a.free_seq, e, 0, -a.size});
    }
    if (a.older_block) {
      bool made = false;
      AddressMap::Slot& slot = adopted.get(a.ptr, made);
      if (made) {
        slot.a = a.size;
        slot.b = e;
      }
    }
  }
  by_storage.each([&](const AddressMap::Slot& slot) {  // new in the region: dead at its end
    Ent& x = ents[slot.b];                               // is freed in it
    if (!x.predates) {
      auto* st = reinterpret_cast<c10::StorageImpl*>(slot.key);
      x.freed = c10::raw::weak_intrusive_ptr::use_count(st) == 0;
      auto m = marks.find(st);
      if (m != marks.end()) {
        x.code = m->second;
      }
    }
  });
  for (const Freed& f : earlier_frees) {
    if (AddressMap::Slot* w = wanted.find(f.ptr)) {
      const int64_t bytes = w->a;
      const int32_t e = ent_of_ptr(f.ptr, bytes, w->b);
      evs.push_back({f.seq, e, 0, -bytes});
      wanted.erase(w);
      ++found;
      continue;
    }
    if (AddressMap::Slot* ad = adopted.find(f.ptr)) {
      evs.push_back({f.seq, ad->b, 0, -ad->a});
      adopted.erase(ad);
    }
  }
  for (const Save& sv : saves) {
    evs.push_back({sv.seq, ent_of(sv.storage), 1, sv.delta});
  }
  // known frees not found in the log: counted at the end (after every event)
  const int64_t end_seq = seq + 1;
  int64_t missing = 0;
  wanted.each([&](const AddressMap::Slot& slot) {  // (ent_of_ptr adds to by_ptr, not here)
    missing += slot.a;
    evs.push_back({end_seq, ent_of_ptr(slot.key, slot.a, slot.b), 0, -slot.a});
  });
  int64_t unplaced = 0;
  for (const Alloc& a : allocs) {
    if (a.adopted && !a.older_block && a.free_seq < 0 &&
        c10::raw::weak_intrusive_ptr::use_count(a.storage) == 0) {
      unplaced += a.size;
      evs.push_back({end_seq, ent_of(a.storage), 0, -a.size});
    }
  }
  std::stable_sort(evs.begin(), evs.end(),
                   [](const Ev& x, const Ev& y) { return x.seq < y.seq; });
  // Walk back from the end to each storage's size and saved count at the start.
  for (auto it = evs.rbegin(); it != evs.rend(); ++it) {
    Ent& x = ents[it->ent];
    if (it->kind == 1) {
      x.saved -= static_cast<int>(it->delta);
    } else if (!x.predates) {
      // (a new storage starts at 0: nothing to undo; older ones start at their first size)
    }
  }
  for (Ent& x : ents) {
    if (x.saved < 0) {
      x.saved = 0;  // a saving the ledger did not count (an alias it never held)
    }
    if (!x.predates) {
      x.size = 0;
    }
  }
  // older storages read by an op, not saved when the region began, with no other role: inputs
  for (int64_t i = 0; i < given; ++i) {
    Ent& x = ents[by_storage.find(reinterpret_cast<uintptr_t>(older_order[i]))->b];
    if (older[older_order[i]].read && x.code == 0 && x.saved == 0) {
      x.code = kInput;
    }
  }
  int64_t sums[kCats] = {}, best[kCats] = {}, highest[kCats] = {};
  int64_t total = 0;
  for (const Ent& x : ents) {
    sums[x.role() - 1] += x.size;
    total += x.size;
  }
  std::copy(sums, sums + kCats, best);
  std::copy(sums, sums + kCats, highest);
  const int64_t start = total;
  int64_t best_total = total;
  pt_total.clear();
  pt_secs.clear();
  pt_phase.clear();
  double last = 0.0;
  const size_t n_ev = evs.size();
  for (size_t i = 0; i < n_ev;) {
    const int64_t at = evs[i].seq;
    bool bytes = false;
    for (; i < n_ev && evs[i].seq == at; ++i) {
      const Ev& ev = evs[i];
      Ent& x = ents[ev.ent];
      if (ev.kind == 0) {
        bytes = true;
        const int c = x.role() - 1;
        sums[c] += ev.delta;
        x.size += ev.delta;
        total += ev.delta;
        highest[c] = std::max(highest[c], sums[c]);
      } else {
        const int was = x.role() - 1;
        x.saved += static_cast<int>(ev.delta);
        const int now = x.role() - 1;
        if (now != was) {
          sums[was] -= x.size;
          sums[now] += x.size;
          highest[now] = std::max(highest[now], sums[now]);
        }
      }
    }
    if (!bytes) {
      continue;
    }
    if (total > best_total) {
      best_total = total;
      std::copy(sums, sums + kCats, best);
    }
    const size_t k = static_cast<size_t>(at);
    double secs = last;
    int8_t phase = pt_phase.empty() ? 0 : pt_phase.back();
    if (k < ev_ns.size()) {
      secs = std::max(last, static_cast<double>(ev_ns[k] - t0_ns) * 1e-9);
      phase = ev_phase[k];
    }
    last = secs;
    pt_total.push_back(total - start);
    pt_secs.push_back(secs);
    pt_phase.push_back(phase);
  }
  for (int c = 0; c < kCats; ++c) {
    cats[c] = best[c];
    cats[kCats + c] = sums[c];
    cats[2 * kCats + c] = highest[c];
  }
  const int64_t all[5] = {best_total - start, total - start, found, missing, unplaced};
  for (int64_t i = 0; i < n_out && i < 5; ++i) {
    out[i] = all[i];
  }
  return static_cast<int64_t>(pt_total.size());
}

// The timeline mn_tally made: the running total (above the start, plus `offset`), seconds since the origin, and
// the phase, of each point (at most cap). Returns how many were written.
int64_t mn_points(int64_t* totals, double* secs, int8_t* phases, int64_t cap, int64_t offset) {
  std::lock_guard<std::mutex> g(mu);
  const int64_t n = std::min<int64_t>(cap, static_cast<int64_t>(pt_total.size()));
  for (int64_t i = 0; i < n; ++i) {
    totals[i] = pt_total[i] + offset;
  }
  std::copy(pt_secs.begin(), pt_secs.begin() + n, secs);
  std::copy(pt_phase.begin(), pt_phase.begin() + n, phases);
  return n;
}
}
