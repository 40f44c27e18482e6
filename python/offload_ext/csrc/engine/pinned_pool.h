// PinnedPool: page-locked host memory for the H2D/D2H buffers, taken in few large slabs (pinned
// in parallel, once) and carved into aligned blocks that are reused; byte counts exposed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace offload_ext {

struct PinnedStats {
  size_t reserved = 0;   // bytes in slabs
  size_t in_use = 0;     // bytes handed out
  size_t slabs = 0;
  bool page_locked = false;  // false on the simulated device or a CPU-only build
};

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  // page_lock: register slabs with the CUDA driver (needs a CUDA build); otherwise plain memory.
  PinnedPool(bool page_lock, size_t slab_bytes, int pin_threads);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A block of at least `bytes` starting `offset` bytes past a page boundary (a multiple of 64: cache
  // lines); the shared_ptr gives it back to the pool when released.
  // zero: the block reads as zeros (free for never-used slab memory, which the OS hands out zeroed).
  std::shared_ptr<void> allocate(size_t bytes, bool zero = false, size_t offset = 0);
  // Adds enough slabs for `bytes` more, created and page-locked concurrently.
  void reserve(size_t bytes);
  // Adds slabs that hold exactly these blocks (each rounded up to a page), consecutive ones packed
  // together up to the slab size, a larger one alone: created and page-locked concurrently. Whole slabs
  // of the slab size would leave a block larger than them nowhere to go but a slab of its own, beside
  // the reserved ones (a B2 layer is 436 MB: its pinned memory came out twice).
  void reserve_blocks(const std::vector<size_t>& blocks);
  PinnedStats stats() const;
  // Unmaps (and unlocks) every slab no block is handed out from; returns the bytes given back. For an
  // owner that is done allocating (an Offloader closing): a later allocate() adds slabs again.
  size_t trim();

 private:
  struct Slab;
  // requires mutex_; touch: fault the pages in on the slab's thread (before page-locking, if any)
  void add_slabs(const std::vector<size_t>& sizes, bool touch);
  void release(char* ptr, size_t bytes);

  const bool page_lock_;
  const size_t slab_bytes_;
  const int pin_threads_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::map<char*, size_t> free_;  // address -> size of free ranges, coalesced within a slab
  std::map<char*, size_t> slab_starts_;  // never coalesce across slabs: each is its own registration
  std::map<char*, char*> high_water_;    // slab start -> end of the highest block ever handed out
  size_t reserved_ = 0;
  size_t in_use_ = 0;
};

}  // namespace offload_ext
