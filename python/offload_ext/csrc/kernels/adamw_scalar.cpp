// AdamW span kernels for CPUs without AVX2: plain float code, the reference the SIMD ones match.
#include "adamw_kernel.h"

OFFLOAD_EXT_DEFINE_SPANS(scalar, ScalarVec)
