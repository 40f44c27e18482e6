// AdamW span kernels (bf16 and 8-bit moments) for CPUs without AVX2: plain float code, the reference the SIMD
// ones match.
#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"

OFFLOAD_EXT_DEFINE_SPANS(scalar, ScalarVec)
OFFLOAD_EXT_DEFINE_8BIT_BLOCKS(scalar, ScalarVec)
