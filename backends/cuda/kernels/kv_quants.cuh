// The quantized KV cache's blocks (core/kv_types.py): ggml's block_q8_0 {half d; i8 qs[32]}
// and block_q4_0 {half d; u8 qs[16]} of 32 values along head_dim, a (slot, head) row being its
// blocks. Quantized as ggml-quants.c's quantize_row_q8_0_ref / quantize_row_q4_0_ref (one
// thread per block: writes are a few rows a step); read one value per lane inside attention.
// Host-compilable, so tests check these against gguf.quants on the CPU.
#pragma once
#include "common.cuh"

enum { KV_F16 = 1, KV_Q4_0 = 2, KV_Q8_0 = 8 };  // ggml's type ids (core.kv_types); F16 is no block type
template <int T> struct KVBlock;
template <> struct KVBlock<KV_Q8_0> { enum { bytes = 34 }; };
template <> struct KVBlock<KV_Q4_0> { enum { bytes = 18 }; };

// float -> IEEE half bits, round to nearest even (the cvt instruction; bit arithmetic on the host)
HD u16 f2h(float f) {
#if defined(__CUDA_ARCH__)
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    union { float f; u32 u; } c;
    c.f = f;
    u32 sign = (c.u >> 16) & 0x8000u, u = c.u & 0x7fffffffu;
    if (u >= 0x47800000u) return (u16)(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));  // inf, NaN
    if (u < 0x38800000u) {  // a half subnormal: one add rounds at its 2^-24 step
        c.u = u;
        c.f += 0.5f;
        return (u16)(sign | (c.u - 0x3f000000u));
    }
    return (u16)(sign | ((u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13));
#endif
}

HD float kv_fabs(float v) { return v < 0.0f ? -v : v; }

HD void st_f16(u8* p, float v) {
    u16 h = f2h(v);
    p[0] = (u8)(h & 0xff);
    p[1] = (u8)(h >> 8);
}

// 1 / d, or 0 where d is 0 or subnormal (ggml: `d ? 1 / d : 0`). On the GPU (-ftz=true) a
// subnormal d is 0 already; on the host 1 / d overflowed to inf there (d < ~2.9e-39) and the
// codes of inf / NaN were undefined. Either way such a d is 0 as a half, so the block reads 0.
HD float kv_inv(float d) { return kv_fabs(d) < F32_MIN_NORMAL ? 0.0f : 1.0f / d; }

template <int T> HD void kv_quantize(const float* x, u8* b);

// d = amax / 127, codes round-half-away(x / d) (roundf)
template <> HD void kv_quantize<KV_Q8_0>(const float* x, u8* b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, kv_fabs(x[j]));
    float d = amax / 127.0f, id = kv_inv(d);
    st_f16(b, d);
    for (int j = 0; j < 32; ++j) b[2 + j] = (u8)(i8)(int)roundf(x[j] * id);
}

// d = (the value of largest magnitude, the first of ties) / -8, codes min(15, trunc(x / d + 8.5))
template <> HD void kv_quantize<KV_Q4_0>(const float* x, u8* b) {
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < 32; ++j)
        if (amax < kv_fabs(x[j])) {
            amax = kv_fabs(x[j]);
            mx = x[j];
        }
    float d = mx / -8.0f, id = kv_inv(d);
    st_f16(b, d);
    for (int j = 0; j < 16; ++j) {
        int lo = (int)(x[j] * id + 8.5f), hi = (int)(x[16 + j] * id + 8.5f);
        b[2 + j] = (u8)((lo < 15 ? lo : 15) | ((hi < 15 ? hi : 15) << 4));
    }
}

// value j (0..31) of block b
template <int T> HD float kv_value(const u8* b, int j);
template <> HD float kv_value<KV_Q8_0>(const u8* b, int j) { return ld_f16(b) * (float)(i8)b[2 + j]; }
template <> HD float kv_value<KV_Q4_0>(const u8* b, int j) {
    int q = b[2 + (j & 15)];
    return ld_f16(b) * (float)(((j < 16 ? q : q >> 4) & 0xf) - 8);
}
