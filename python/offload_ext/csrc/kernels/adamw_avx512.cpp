// AdamW span kernels (bf16 and 8-bit moments) for AVX-512F (16 floats a vector, adamw_avx512_vec.h). This file
// and adamw8bit_avx512vbmi.cpp are the ones compiled for AVX-512; the dispatchers call them after checking the
// CPU at run time.
#include <cstdint>

#include "adamw.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

#include "adamw8bit_kernel.h"
#include "adamw_avx512_vec.h"
#include "adamw_kernel.h"

OFFLOAD_EXT_DEFINE_SPANS(avx512, Avx512Vec)
OFFLOAD_EXT_DEFINE_8BIT_BLOCKS(avx512, Avx512Vec)
#pragma GCC pop_options
