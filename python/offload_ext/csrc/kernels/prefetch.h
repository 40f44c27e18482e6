// A software prefetch of one cache line into the cache PrefetchLevel names (adamw.h), for the vector types of
// every x86 ISA. Internal linkage, as adamw_kernel.h's loops: each ISA's translation unit keeps its own copy.
#pragma once

#include <xmmintrin.h>

namespace offload_ext {
namespace {

// The hint is a constant in each instruction; in a loop with a fixed level the compiler unswitches the choice.
inline void prefetch_line(const void* p, int level) {
  const char* a = static_cast<const char*>(p);
  if (level == 1) {
    _mm_prefetch(a, _MM_HINT_T1);
  } else if (level == 2) {
    _mm_prefetch(a, _MM_HINT_NTA);
  } else {
    _mm_prefetch(a, _MM_HINT_T0);
  }
}

}  // namespace
}  // namespace offload_ext
