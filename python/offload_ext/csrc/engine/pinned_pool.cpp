// PinnedPool: slabs from mmap (huge-page advised), faulted in and page-locked with cudaHostRegister
// on one thread per slab (pinning is per page and dominates set-up), best-fit carving with coalescing.
// A pageable pool faults its reserved slabs in the same way: left to the first step that writes them,
// the faults cost a B2 layer's speculative step 150 ms instead of 30.
#include "pinned_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <string>
#include <thread>

#ifdef OFFLOAD_EXT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace offload_ext {

namespace {
constexpr size_t kAlign = 4096;
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

bool prefault_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("OFFLOAD_EXT_PREFAULT");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}
}  // namespace

// An anonymous mapping, unmapped when it goes: a Slab whose page-locking throws leaks nothing.
class Mapping {
 public:
  explicit Mapping(size_t n) : bytes_(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error("PinnedPool: out of host memory allocating " + std::to_string(n) + " bytes");
    }
    base_ = static_cast<char*>(p);
  }
  ~Mapping() { munmap(base_, bytes_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  char* base() const { return base_; }

 private:
  char* base_ = nullptr;
  size_t bytes_;
};

struct PinnedPool::Slab {
  Mapping mapping;
  char* base = nullptr;
  size_t bytes = 0;
  bool registered = false;

  Slab(size_t n, bool page_lock, bool touch) : mapping(n), base(mapping.base()), bytes(n) {
    madvise(base, n, MADV_HUGEPAGE);  // fewer TLB misses for the AdamW streams; advisory only
    if (touch) touch_pages();
    if (page_lock) register_pages();
  }

  // Fault the (zeroed) pages in on this thread: the driver's registration then only locks them, and
  // the zeroing runs on as many threads as there are slabs instead of inside the driver call.
  void touch_pages() {
    volatile char* p = base;
    for (size_t off = 0; off < bytes; off += kAlign) p[off] = 0;
  }

  void register_pages() {
#ifdef OFFLOAD_EXT_WITH_CUDA
    const cudaError_t err = cudaHostRegister(base, bytes, cudaHostRegisterDefault);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("PinnedPool: cudaHostRegister failed: ") + cudaGetErrorString(err));
    }
    registered = true;
#else
    throw std::runtime_error("PinnedPool: page-locking needs the CUDA build of offload_ext");
#endif
  }

  ~Slab() {
#ifdef OFFLOAD_EXT_WITH_CUDA
    if (registered) cudaHostUnregister(base);
#endif
  }
};

PinnedPool::PinnedPool(bool page_lock, size_t slab_bytes, int pin_threads)
    : page_lock_(page_lock), slab_bytes_(std::max(round_up(slab_bytes, kAlign), kAlign)),
      pin_threads_(std::max(1, pin_threads)) {}

PinnedPool::~PinnedPool() = default;

void PinnedPool::add_slabs(const std::vector<size_t>& sizes, bool touch) {
  // Page-locking costs per page: slabs are made on several threads at once.
  std::vector<std::unique_ptr<Slab>> made(sizes.size());
  std::vector<std::exception_ptr> errors(sizes.size());
  std::vector<std::thread> threads;
  auto make = [&](size_t k) {
    try {
      made[k] = std::make_unique<Slab>(sizes[k], page_lock_, touch);
    } catch (...) {
      errors[k] = std::current_exception();
    }
  };
  for (size_t k = 0; k < sizes.size(); ++k) {
    try {
      threads.emplace_back(make, k);
    } catch (const std::system_error&) {
      make(k);  // no thread to spare: this one makes it (a joinable thread destroyed would end the process)
    }
    if (static_cast<int>(threads.size()) >= pin_threads_) {
      for (auto& t : threads) t.join();
      threads.clear();
    }
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (auto& slab : made) {
    free_[slab->base] = slab->bytes;
    slab_starts_[slab->base] = slab->bytes;
    reserved_ += slab->bytes;
    slabs_.push_back(std::move(slab));
  }
}

void PinnedPool::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> sizes;
  for (size_t left = round_up(bytes, kAlign); left > 0; left -= std::min(left, slab_bytes_)) {
    sizes.push_back(slab_bytes_);  // whole slabs: blocks are carved from them best-fit
  }
  add_slabs(sizes, prefault_enabled());
}

void PinnedPool::reserve_blocks(const std::vector<size_t>& blocks) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> sizes;
  size_t current = 0;
  for (size_t b : blocks) {
    const size_t need = round_up(std::max<size_t>(b, 1), kAlign);
    if (current > 0 && current + need > slab_bytes_) {
      sizes.push_back(current);
      current = 0;
    }
    current += need;
  }
  if (current > 0) sizes.push_back(current);
  add_slabs(sizes, prefault_enabled());
}

std::shared_ptr<void> PinnedPool::allocate(size_t bytes, bool zero, size_t offset) {
  if (offset % 64 != 0 || offset >= kAlign) {
    throw std::invalid_argument("PinnedPool: expected an offset that is a multiple of 64 below 4096, got " +
                                std::to_string(offset));
  }
  const size_t need = round_up(std::max<size_t>(bytes, 1) + offset, kAlign);
  std::lock_guard<std::mutex> lock(mutex_);
  // Best fit: slabs reserved to hold given blocks are filled as planned, whatever their address order.
  auto best_fit = [&] {
    auto best = free_.end();
    for (auto i = free_.begin(); i != free_.end(); ++i) {
      if (i->second >= need && (best == free_.end() || i->second < best->second)) best = i;
    }
    return best;
  };
  auto it = best_fit();
  if (it == free_.end()) {
    // Unplanned: a pageable slab stays lazy (it may be larger than what it will hold).
    add_slabs({std::max(need, slab_bytes_)}, page_lock_ && prefault_enabled());
    it = best_fit();
  }
  char* ptr = it->first;
  const size_t rest = it->second - need;
  free_.erase(it);
  if (rest) free_[ptr + need] = rest;
  in_use_ += need;
  char* slab = std::prev(slab_starts_.upper_bound(ptr))->first;
  char*& high = high_water_[slab];
  if (high == nullptr) high = slab;
  if (zero && ptr < high) std::memset(ptr, 0, need);  // reused memory; fresh pages are zero already
  high = std::max(high, ptr + need);
  // Each block keeps the pool (and so its slab) alive: a tensor may outlive its engine.
  std::shared_ptr<PinnedPool> self = shared_from_this();
  return std::shared_ptr<void>(ptr + offset, [self, ptr, need](void*) { self->release(ptr, need); });
}

void PinnedPool::release(char* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= bytes;
  auto [it, inserted] = free_.emplace(ptr, bytes);
  (void)inserted;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first && !slab_starts_.count(next->first)) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first && !slab_starts_.count(it->first)) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

size_t PinnedPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t freed = 0;
  // A slab is unused when its start begins a free range as long as the slab (ranges coalesce within it).
  auto unused = [&](const std::unique_ptr<Slab>& slab) {
    const auto f = free_.find(slab->base);
    return f != free_.end() && f->second == slab->bytes;
  };
  for (auto& slab : slabs_) {
    if (!unused(slab)) continue;
    free_.erase(slab->base);
    slab_starts_.erase(slab->base);
    high_water_.erase(slab->base);
    reserved_ -= slab->bytes;
    freed += slab->bytes;
    slab.reset();  // unlocks and unmaps it
  }
  slabs_.erase(std::remove(slabs_.begin(), slabs_.end(), nullptr), slabs_.end());
  return freed;
}

PinnedStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {reserved_, in_use_, slabs_.size(), page_lock_};
}

}  // namespace offload_ext
