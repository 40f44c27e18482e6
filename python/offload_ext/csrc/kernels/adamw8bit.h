// AdamW with 8-bit moments ("bf16-8bit"): bf16 params, exp_avg and exp_avg_sq as uint8 indices into 256-code
// maps with an fp32 absmax per block of kBlock elements. The rule is offload_ext/optim/eight_bit.py's, which
// states it in full; this dispatcher picks the ISA and spreads whole blocks over the ThreadPool.
#pragma once

#include <cstdint>
#include <optional>

#include "adamw.h"

namespace offload_ext {

constexpr int64_t kBlock = 256;  // elements a block: one absmax of each moment
constexpr int kCodes = 256;      // codes a map

inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Where one 8-bit pass reads and writes (pointers at element 0 of the span, which starts a block). In place by
// default; out of place (speculative clipping, as adamw.h's passes) the state is read from `in`'s pointers and
// the state before the pass survives there.
struct EightBitState {
  const uint16_t* param;  // bf16
  const uint8_t* exp_avg;
  const uint8_t* exp_avg_sq;
  const float* exp_avg_absmax;
  const float* exp_avg_sq_absmax;
};
struct EightBitPass {
  uint16_t* param;  // bf16
  const void* grad;
  GradType grad_type;
  uint8_t* exp_avg;     // indices into exp_avg_code
  uint8_t* exp_avg_sq;  // indices into exp_avg_sq_code
  float* exp_avg_absmax;     // one a block
  float* exp_avg_sq_absmax;
  const float* exp_avg_code;     // kCodes values, strictly increasing
  const float* exp_avg_sq_code;
  // bf16 gradients only: the step uses bf16(grad_add + grad) (the last micro-batch) or bf16(grad * grad_scale)
  // (clipping), one rounding each, as adamw.h's bf16 pass does.
  const uint16_t* grad_add = nullptr;
  float grad_scale = 1.0f;
  Parts parts = Parts::kAll;  // which stores the pass makes (adamw.h): kParams leaves moments and absmax alone
  std::optional<EightBitState> in;  // out of place: where the state is read
};

// The AVX-512 encoder's arithmetic form of a map whose midpoints are the dynamic maps' (eight_bit.py): those of
// negative x the negatives of those of positive x, and the non-negative ones P cut by 8 "anchors" into 9
// segments, each a linear run: in segment s the midpoint of rank r within it lies where pos(x) = fma(x, slope[s],
// offset[s]) is near base[s] + r + 1, base[s] the count of P up to the segment's lower anchor (folded into
// offset). The count of P below a magnitude a is then floor(min(pos(a), limit[s])), limit[s] being the
// segment's last count plus a half; it is exact wherever pos(a) is at least kLinearMargin from an integer: pos
// is monotone, each midpoint's pos lies within kLinearMargin of its integer, and the lower anchor's at least
// base[s] - kLinearMargin (build_linear checks both, the argument's only premises). The rarer rest is searched.
// An x's segment is #anchors below it: that of the least float of its binade (segment_of_exponent, by its
// exponent clamped to 32 values, modulo 32) or one more, each binade holding at most one anchor. A map that does not fit (usable
// false; the op takes any increasing map) keeps the bucket table or the search, as the other ISAs do.
constexpr float kLinearMargin = 1.0f / 4096;
constexpr int kLinearBinade0 = 104;  // the exponent field of binade 0; those below and above clamp to 0 and 31
struct LinearEncoder {
  bool usable;
  int32_t zero;  // the midpoints below 0 (their count of negative x's codes), each the negative of one of P
  float anchor[16];  // segment s starts above anchor[s - 1]; past the 8 anchors +inf
  int32_t segment_of_exponent[32];  // binade c (exponent field kLinearBinade0 + c) at (kLinearBinade0 + c) % 32
  float slope[16];
  float offset[16];
  float limit[16];
};

// What the encoder reads of one map. `mid`: the 255 midpoints between neighbouring codes (its thresholds), then
// +inf. `below`: for each bucket of floats sharing their top 16 bits, how many midpoints lie below its least
// value; where no bucket holds two midpoints (`bucketed`, true of the dynamic maps) an index is that count plus
// one comparison, the same count the binary search over `mid` finds. `linear`: the AVX-512 encoder's form of it.
// `planes`: the codes themselves, a byte plane each, which VBMI's byte permutes look up 64 at a time.
constexpr int kBuckets = 1 << 16;
struct MapTables {
  float mid[kCodes];
  uint8_t planes[4][kCodes];  // byte k of each code's bits (least significant first): the VBMI decoder's tables
  uint8_t below[kBuckets + 3];  // read 4 bytes at a time (32-bit gathers): 3 past the last
  bool bucketed;
  LinearEncoder linear;
};

// What the block loops read besides the pass: each moment's map tables, and the stochastic rounding of the
// param, when on, by stochastic_rounding.h's stream.
struct EightBitTables {
  const MapTables* exp_avg;
  const MapTables* exp_avg_sq;
  bool stochastic = false;
  uint64_t sr_seed = 0;
  uint64_t sr_stream = 0;
  int64_t sr_index = 0;  // the stream index of the span's element 0
  int64_t step = 0;
};

// One step over n elements; with `sr` the param is stored by stochastic rounding (exp_avg_sq is no bf16 here).
void adamw8bit(const EightBitPass& pass, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level,
               const std::optional<SrStream>& sr = std::nullopt);

// Per-ISA block loops over blocks [first, last) of a span of n elements, each in its ISA's translation unit.
#define OFFLOAD_EXT_DECLARE_8BIT_BLOCKS(isa)                                                      \
  void adamw8bit_blocks_##isa(const EightBitPass& pass, int64_t n, int64_t first, int64_t last, \
                              const EightBitTables& t, const AdamWCoef& c);
OFFLOAD_EXT_DECLARE_8BIT_BLOCKS(scalar)
OFFLOAD_EXT_DECLARE_8BIT_BLOCKS(avx2)
OFFLOAD_EXT_DECLARE_8BIT_BLOCKS(avx512)
OFFLOAD_EXT_DECLARE_8BIT_BLOCKS(avx512vbmi)
#undef OFFLOAD_EXT_DECLARE_8BIT_BLOCKS

}  // namespace offload_ext
