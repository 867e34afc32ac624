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

#include <pthread.h>

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
std::vector<Alloc>& allocs = *new std::vector<Alloc>();
std::vector<Freed>& earlier_frees = *new std::vector<Freed>();  // of blocks from before
std::vector<Read>& reads = *new std::vector<Read>();
// (place in the order, bytes added)
std::vector<std::pair<int64_t, int64_t>>& resizes = *new std::vector<std::pair<int64_t, int64_t>>();
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
};
std::vector<Move>& moves = *new std::vector<Move>();
// The block of this region each storage an op returned lives in now (index in `allocs`).
std::unordered_map<c10::StorageImpl*, size_t>& current =
    *new std::unordered_map<c10::StorageImpl*, size_t>();
// Adopted storages not of the wrapper's memory, alive when last looked at (indexes in
// `allocs`): their free cannot be seen, so each op looks whether they died since (a
// DataLoader's batches in shared memory come and go; few are alive at once).
std::vector<size_t>& adopted_alive = *new std::vector<size_t>();

// The adopted storages that died since the last look: freed here in the order. Under `mu`.
void look_at_adopted() {
  size_t kept = 0;
  for (size_t i : adopted_alive) {
    Alloc& a = allocs[i];
    if (c10::raw::weak_intrusive_ptr::use_count(a.storage) == 0) {
      a.free_seq = seq++;
    } else {
      adopted_alive[kept++] = i;
    }
  }
  adopted_alive.resize(kept);
}
// Storages already handed to the ledger (weakly held, so an address is never reused while in
// here): a later region's reads skip them. Pruned of the dead as it grows.
std::unordered_set<c10::StorageImpl*>& reported = *new std::unordered_set<c10::StorageImpl*>();
size_t prune_at = 4096;
int64_t reported_to = 0;  // the ledger they were handed to (its Python identity)
at::CallbackHandle handle = 0;
int64_t marked = 0;
int64_t limit = 10'000'000;  // events kept per region; beyond it the region is lost
bool overflow = false;
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
        if (b.region == region) {
          allocs[b.index].free_seq = seq++;
        } else if (earlier_frees.size() < static_cast<size_t>(limit)) {
          earlier_frees.push_back({it->first, b.size, seq++});
        } else {
          overflow = true;
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
          allocs.push_back(
              {key, static_cast<int64_t>(n), seq++, -1, nullptr, false, false, false});
        } else {
          overflow = true;
        }
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

void release_deferred() {  // never under `mu`
  std::vector<c10::StorageImpl*> now;
  {
    std::lock_guard<std::mutex> g(mu);
    now.swap(to_release);
  }
  for (c10::StorageImpl* s : now) {
    c10::raw::weak_intrusive_ptr::decref(s);
  }
}

void seen(c10::StorageImpl* s) {  // under `mu`
  if (read_seen.insert(s).second) {
    c10::raw::weak_intrusive_ptr::incref(s);
  }
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
    return;
  }
  auto it = live.find(key);
  if (it != live.end() && it->second.region == region && it->second.index >= 0 &&
      allocs[it->second.index].storage == s) {
    return;  // memory an op returned in this region: the region's, not something read
  }
  // older memory; or a block of this region no op the record saw returned (made by another
  // thread, or the data `torch.tensor` is about to lift): read, unless an op returns it later
  c10::raw::weak_intrusive_ptr::incref(s);
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
      moves.push_back({a.seq, before.size, before.ptr});
      before.superseded = true;
    } else if (r != read_index.end()) {
      Read& read = reads[r->second];
      if (read.ptr == key) {
        read.taken = true;  // its own block, read before an op returned it: the region's
      } else if (!read.moved) {  // an older storage, grown into this block
        moves.push_back({a.seq, read.size, read.ptr});
        read.moved = true;
      }
    } else if (rr != reported_reads.end() && rr->second.first != key) {
      moves.push_back({a.seq, rr->second.second, rr->second.first});
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
  allocs.push_back(
      {key, static_cast<int64_t>(s->nbytes()), seq++, -1, s, true, older_block, false});
  ++marked;
  seen(s);
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
  std::lock_guard<std::mutex> g(mu);
  if (region == 0) {
    return nullptr;
  }
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    // inside a torch.func transform: its layers run the ops on plain tensors inside kernels of
    // their own, where this route does not follow them (the dispatch-key route does)
    transformed = true;
  }
  if (!adopted_alive.empty()) {
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
  }
  if (subclass) {  // are seen, as a dispatch mode above the subclass sees them
    running.back() = 1;
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
  {
    std::lock_guard<std::mutex> g(mu);
    mine = route == 1 ? region : 0;
    if (mine == 0) {  // a stale key (see above): off this thread from now on
      key_off();
    } else if (!adopted_alive.empty()) {
      look_at_adopted();
    }
    if (mine != 0 && n_in <= stack->size()) {
      for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n_in); it != stack->end(); ++it) {
        each_tensor(*it, read_storage);
      }
    }
  }
  {
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
  if (reported.insert(s).second) {
    c10::raw::weak_intrusive_ptr::incref(s);
  }
}

void forget_reported() {
  for (c10::StorageImpl* s : reported) {
    to_release.push_back(s);
  }
  reported.clear();
}

void prune_reported() {
  if (reported.size() < prune_at) {
    return;
  }
  for (auto it = reported.begin(); it != reported.end();) {
    if (c10::raw::weak_intrusive_ptr::use_count(*it) == 0) {
      to_release.push_back(*it);
      it = reported.erase(it);
    } else {
      ++it;
    }
  }
  prune_at = 2 * reported.size() + 4096;
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
  allocs.clear();
  earlier_frees.clear();
  reads.clear();
  read_seen.clear();
  read_index.clear();
  reported_reads.clear();
  moves.clear();
  adopted_alive.clear();
  current.clear();
  resizes.clear();
  marked = 0;
  seq = 0;
}

}  // namespace

extern "C" {

int mn_version() {
  return 4;
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

// Opens a region on the calling thread, for the ledger whose identity is `ledger`. 0: open;
// 1: another region is open (or its record is not yet released); 2: PyTorch's CPU allocator
// could not be replaced (a higher-priority allocator is set); 3: failed otherwise.
int begin_locked(int64_t max_events, int64_t ledger) {
  try {
    std::lock_guard<std::mutex> g(mu);
    if (region != 0 || held) {
      return 1;  // a region is open, or its record not yet read
    }
    if (!at::isRecordFunctionEnabled()) {
      return 3;
    }
    if (!installed) {
      c10::Allocator* current = c10::GetCPUAllocator();
      c10::SetCPUAllocator(&wrapper, 0);
      if (c10::GetCPUAllocator() != &wrapper) {
        return 2;
      }
      original = current;
      installed = true;
    } else if (c10::GetCPUAllocator() != &wrapper) {
      return 2;  // replaced since by other code: not ours to take back
    }
    drop_weak_refs();
    if (ledger != reported_to) {  // another ledger: it knows none of the storages reported
      forget_reported();
      reported_to = ledger;
    }
    prune_reported();
    limit = max_events > 0 ? max_events : limit;
    overflow = false;
    transformed = false;
    seq = 0;
    marked = 0;
    region = ++regions;
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

int mn_begin(int64_t max_events, int64_t ledger) {
  const int code = begin_locked(max_events, ledger);
  release_deferred();
  return code;
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
  if (!adopted_alive.empty()) {
    look_at_adopted();
  }
  region = 0;
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
  for (const auto& r : resizes) {
    delta[r.first] += r.second;
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
int mn_resized(uintptr_t old_ptr, uintptr_t new_ptr, int64_t added) {
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
      moves.push_back({fresh->seq, before->size, old_ptr});
      before->superseded = true;
      current[owner] = static_cast<size_t>(nb->second.index);
    }
    return 1;
  }
  resizes.push_back({seq, added});
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
  forget_reported();
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
}
