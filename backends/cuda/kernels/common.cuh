// Helpers shared by every kernel file. No #include: the sources are compiled by NVRTC
// (through cupy.RawModule), which has no C++ standard headers; modules.py inlines this file.
#pragma once

#if !defined(__CUDACC__)  // plain C++: tests run the unpacking (quants.cuh) on the CPU
#define __device__
#define __host__
#define __forceinline__ inline
#endif

#define HD __host__ __device__ __forceinline__

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

HD float bits_f32(u32 b) {
    union { u32 u; float f; } c;
    c.u = b;
    return c.f;
}

// IEEE half -> float (the cvt instruction on the GPU; bit arithmetic on the host)
HD float h2f(u16 h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 sign = (u32)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (ex == 0) {
        if (man == 0) return bits_f32(sign);
        ex = 113;  // subnormal: normalize (2^-14 * 0.man)
        while (!(man & 0x400u)) { man <<= 1; --ex; }
        return bits_f32(sign | (ex << 23) | ((man & 0x3ffu) << 13));
    }
    if (ex == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
    return bits_f32(sign | ((ex + 112) << 23) | (man << 13));
#endif
}

HD float ld_f16(const u8* p) { return h2f(*(const u16*)p); }

// 4 bytes from a 2-byte aligned address (blocks of 18, 22, 34, 110, 210 bytes are only that)
HD int ld_i32_b2(const u8* p) {
    const u16* q = (const u16*)p;
    return (int)((u32)q[0] | ((u32)q[1] << 16));
}

HD int ld_i32_b4(const u8* p) { return *(const int*)p; }

// the smallest normal float: CuPy compiles with -ftz=true, so on the GPU anything below it is 0
#define F32_MIN_NORMAL 1.17549435e-38f

// float -> int, round half to even, saturating, NaN -> 0 (the cvt.rni.s32.f32 instruction;
// the same semantics on the host)
HD int f2i_rn(float x) {
#if defined(__CUDA_ARCH__)
    return __float2int_rn(x);
#else
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x <= -2147483648.0f) return -2147483647 - 1;
    return (int)__builtin_rintf(x);  // the default rounding mode: to nearest even
#endif
}

// sum of the four signed byte products, plus c
HD int dp4a(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#else
    for (int i = 0; i < 4; ++i) c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
#endif
}

// bytewise a - b (mod 256, no borrow between bytes): Hacker's Delight 2-18
HD int vsub4(int a, int b) {
    const u32 H = 0x80808080u, ua = (u32)a, ub = (u32)b;
    return (int)(((ua | H) - (ub & ~H)) ^ ((ua ^ ~ub) & H));
}

// bit k (k < 4) of `bits` -> bit 4 of byte k: the 5th bit of four 5-bit codes
HD int bit4_to_bytes(u32 bits) {
    return (int)(((bits << 4) & 0x10u) | ((bits << 11) & 0x1000u) | ((bits << 18) & 0x100000u) |
                 ((bits << 25) & 0x10000000u));
}

#if defined(__CUDACC__)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
#endif
