// Reading raw GGUF blocks (ggml-common.h layouts) as they sit in the file: every type is
// seen through one window, a chunk of 32 consecutive weights of a row (a whole block of
// the 32-weight types, an eighth of a 256-weight K-quant super-block). A chunk unpacks to
// 32 signed int8 codes and an affine map per half, so one dp4a dot product against int8
// activations (llama.cpp's mmvq) and one dequantizer serve all ten types:
//     weight[i] = d[i / 16] * code[i] + m[i / 16]
// Codes are centred (Q4_0's q - 8, Q6_K's q - 32, ...); types with a stored minimum centre
// them too and fold the shift into m, since the int8 rounding error of the activations is
// weighted by the codes (smaller codes, smaller error). Type ids are ggml's.
#pragma once
#include "common.cuh"

struct Chunk {
    int q[8];     // byte i of q[j] is code 4j + i
    float d[2];   // scale of codes 0..15 and 16..31
    float m[2];   // offset of the same halves
};

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

template <int T> struct Block;  // bytes per block, weights per block
template <> struct Block<Q4_0> { enum { bytes = 18, n = 32 }; };
template <> struct Block<Q4_1> { enum { bytes = 20, n = 32 }; };
template <> struct Block<Q5_0> { enum { bytes = 22, n = 32 }; };
template <> struct Block<Q5_1> { enum { bytes = 24, n = 32 }; };
template <> struct Block<Q8_0> { enum { bytes = 34, n = 32 }; };
template <> struct Block<Q2_K> { enum { bytes = 84, n = 256 }; };
template <> struct Block<Q3_K> { enum { bytes = 110, n = 256 }; };
template <> struct Block<Q4_K> { enum { bytes = 144, n = 256 }; };
template <> struct Block<Q5_K> { enum { bytes = 176, n = 256 }; };
template <> struct Block<Q6_K> { enum { bytes = 210, n = 256 }; };

HD void same_halves(Chunk& k, float d, float m) {
    k.d[0] = k.d[1] = d;
    k.m[0] = k.m[1] = m;
}

// block_q4_0 {half d; u8 qs[16]}: weight j < 16 is the low nibble of qs[j], 16 + j the high one
HD void unpack_q4_0(const u8* b, Chunk& k) {
    for (int i = 0; i < 4; ++i) {
        int v = ld_i32_b2(b + 2 + 4 * i);
        k.q[i] = vsub4(v & 0x0F0F0F0F, 0x08080808);
        k.q[i + 4] = vsub4((v >> 4) & 0x0F0F0F0F, 0x08080808);
    }
    same_halves(k, ld_f16(b), 0.0f);
}

// block_q4_1 {half d, m; u8 qs[16]}: weight = d * q + m = d * (q - 8) + (m + 8d)
HD void unpack_q4_1(const u8* b, Chunk& k) {
    for (int i = 0; i < 4; ++i) {
        int v = ld_i32_b4(b + 4 + 4 * i);
        k.q[i] = vsub4(v & 0x0F0F0F0F, 0x08080808);
        k.q[i + 4] = vsub4((v >> 4) & 0x0F0F0F0F, 0x08080808);
    }
    float d = ld_f16(b);
    same_halves(k, d, ld_f16(b + 2) + 8.0f * d);
}

// block_q5_0 {half d; u8 qh[4]; u8 qs[16]}: bit j of qh is the 5th bit of weight j; q - 16
HD void unpack_q5_0(const u8* b, Chunk& k) {
    u32 qh = (u32)ld_i32_b2(b + 2);
    for (int i = 0; i < 4; ++i) {
        int v = ld_i32_b2(b + 6 + 4 * i);
        k.q[i] = vsub4((v & 0x0F0F0F0F) | bit4_to_bytes(qh >> (4 * i)), 0x10101010);
        k.q[i + 4] = vsub4(((v >> 4) & 0x0F0F0F0F) | bit4_to_bytes(qh >> (4 * i + 16)), 0x10101010);
    }
    same_halves(k, ld_f16(b), 0.0f);
}

// block_q5_1 {half d, m; u8 qh[4]; u8 qs[16]}: weight = d * q + m
HD void unpack_q5_1(const u8* b, Chunk& k) {
    u32 qh = (u32)ld_i32_b4(b + 4);
    for (int i = 0; i < 4; ++i) {
        int v = ld_i32_b4(b + 8 + 4 * i);
        k.q[i] = vsub4((v & 0x0F0F0F0F) | bit4_to_bytes(qh >> (4 * i)), 0x10101010);
        k.q[i + 4] = vsub4(((v >> 4) & 0x0F0F0F0F) | bit4_to_bytes(qh >> (4 * i + 16)), 0x10101010);
    }
    float d = ld_f16(b);
    same_halves(k, d, ld_f16(b + 2) + 16.0f * d);
}

// block_q8_0 {half d; i8 qs[32]}
HD void unpack_q8_0(const u8* b, Chunk& k) {
    for (int i = 0; i < 8; ++i) k.q[i] = ld_i32_b2(b + 2 + 4 * i);
    same_halves(k, ld_f16(b), 0.0f);
}

// block_q2_K {u8 scales[16]; u8 qs[64]; half d, dmin}: weight 128h + 32r + i is bits 2r..2r+1
// of qs[32h + i]; sub-block s (16 weights) has scale d * (scales[s] & 15), min dmin * (scales[s] >> 4)
HD void unpack_q2_k(const u8* b, int j, Chunk& k) {
    const u8* qs = b + 16 + 32 * (j / 4);
    int sh = 2 * (j % 4);
    for (int i = 0; i < 8; ++i) k.q[i] = vsub4((ld_i32_b4(qs + 4 * i) >> sh) & 0x03030303, 0x02020202);
    float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
    for (int h = 0; h < 2; ++h) {
        int s = b[2 * j + h];
        k.d[h] = d * (float)(s & 15);
        k.m[h] = 2.0f * k.d[h] - dmin * (float)(s >> 4);
    }
}

// block_q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d}: low 2 bits as Q2_K; bit j of
// hmask[i] set means no -4 for weight 32j + i; 16 six-bit scales, minus 32
HD void unpack_q3_k(const u8* b, int j, Chunk& k) {
    const u8* qs = b + 32 + 32 * (j / 4);
    int sh = 2 * (j % 4);
    for (int i = 0; i < 8; ++i) {
        int lo = (ld_i32_b2(qs + 4 * i) >> sh) & 0x03030303;
        int hi = (ld_i32_b2(b + 4 * i) >> j) & 0x01010101;
        k.q[i] = vsub4(lo, (hi ^ 0x01010101) << 2);
    }
    const u8* sc = b + 96;
    float d = ld_f16(b + 108);
    for (int h = 0; h < 2; ++h) {
        int s = 2 * j + h;
        int v = ((sc[s % 8] >> (4 * (s / 8))) & 15) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
        k.d[h] = d * (float)(v - 32);
        k.m[h] = 0.0f;
    }
}

// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins of sub-block j (ggml's get_scale_min_k4)
HD void scale_min_k4(int j, const u8* s, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// block_q4_K {half d, dmin; u8 scales[12]; u8 qs[128]}: per 64 weights 32 bytes, low nibbles
// the first 32 (sub-block 2g), high nibbles the next 32 (sub-block 2g + 1)
HD void unpack_q4_k(const u8* b, int j, Chunk& k) {
    const u8* qs = b + 16 + 32 * (j / 2);
    int sh = 4 * (j % 2);
    for (int i = 0; i < 8; ++i) k.q[i] = vsub4((ld_i32_b4(qs + 4 * i) >> sh) & 0x0F0F0F0F, 0x08080808);
    int sc, mn;
    scale_min_k4(j, b + 4, sc, mn);
    float d = ld_f16(b) * (float)sc;
    same_halves(k, d, 8.0f * d - ld_f16(b + 2) * (float)mn);
}

// block_q5_K {half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: Q4_K plus bit j of qh[i]
// as the 5th bit of weight 32j + i
HD void unpack_q5_k(const u8* b, int j, Chunk& k) {
    const u8* qs = b + 48 + 32 * (j / 2);
    int sh = 4 * (j % 2);
    for (int i = 0; i < 8; ++i) {
        int lo = (ld_i32_b4(qs + 4 * i) >> sh) & 0x0F0F0F0F;
        int hi = ((ld_i32_b4(b + 16 + 4 * i) >> j) & 0x01010101) << 4;
        k.q[i] = vsub4(lo | hi, 0x10101010);
    }
    int sc, mn;
    scale_min_k4(j, b + 4, sc, mn);
    float d = ld_f16(b) * (float)sc;
    same_halves(k, d, 16.0f * d - ld_f16(b + 2) * (float)mn);
}

// block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}: weight 128h + 32r + i has low
// nibble (r < 2 ? low : high) of ql[64h + 32(r % 2) + i], high 2 bits 2r.. of qh[32h + i]; q - 32
HD void unpack_q6_k(const u8* b, int j, Chunk& k) {
    int h = j / 4, r = j % 4;
    const u8* ql = b + 64 * h + 32 * (r % 2);
    const u8* qh = b + 128 + 32 * h;
    for (int i = 0; i < 8; ++i) {
        int lo = (ld_i32_b2(ql + 4 * i) >> (4 * (r / 2))) & 0x0F0F0F0F;
        int hi = ((ld_i32_b2(qh + 4 * i) >> (2 * r)) & 0x03030303) << 4;
        k.q[i] = vsub4(lo | hi, 0x20202020);
    }
    float d = ld_f16(b + 208);
    const i8* sc = (const i8*)(b + 192);
    for (int s = 0; s < 2; ++s) {
        k.d[s] = d * (float)sc[2 * j + s];
        k.m[s] = 0.0f;
    }
}

// chunk c (weights 32c .. 32c + 31) of a row of type T
template <int T> HD void unpack(const u8* row, int c, Chunk& k) {
    if (Block<T>::n == 32) {
        const u8* b = row + (long long)c * Block<T>::bytes;
        if (T == Q4_0) unpack_q4_0(b, k);
        if (T == Q4_1) unpack_q4_1(b, k);
        if (T == Q5_0) unpack_q5_0(b, k);
        if (T == Q5_1) unpack_q5_1(b, k);
        if (T == Q8_0) unpack_q8_0(b, k);
    } else {
        const u8* b = row + (long long)(c / 8) * Block<T>::bytes;
        if (T == Q2_K) unpack_q2_k(b, c % 8, k);
        if (T == Q3_K) unpack_q3_k(b, c % 8, k);
        if (T == Q4_K) unpack_q4_k(b, c % 8, k);
        if (T == Q5_K) unpack_q5_k(b, c % 8, k);
        if (T == Q6_K) unpack_q6_k(b, c % 8, k);
    }
}

// weight i (0..31) of an unpacked chunk
HD float chunk_weight(const Chunk& k, int i) {
    int code = (int)(i8)(k.q[i / 4] >> (8 * (i % 4)));
    return k.d[i / 16] * (float)code + k.m[i / 16];
}

// Activations as llama.cpp's q8_1, a chunk of 32 whose largest magnitude is amax: the scale
// d = amax / 127 and codes round(v / d). A d below the smallest normal float counts as 0, and so
// do the chunk's codes: under CuPy's -ftz=true such a d flushes to 0 on the GPU, where v / d
// then made +-inf or NaN codes (an amax under 127 * F32_MIN_NORMAL, ~1.5e-36). Thus a chunk of
// tiny values quantizes to zeros alike with FTZ and without it (the host), and d >= F32_MIN_NORMAL
// keeps |v / d| <= 127 (+ rounding), no overflow; the clamp only guards that rounding. A NaN
// amax stays NaN (propagates, as before).
HD float q8_scale(float amax) {
    float d = amax / 127.0f;
    return d < F32_MIN_NORMAL ? 0.0f : d;
}

HD int q8_code(float v, float d) {
    if (d == 0.0f) return 0;
    int q = f2i_rn(v / d);
    return q < -127 ? -127 : (q > 127 ? 127 : q);
}

// dot of a chunk with 32 int8 activations x = d8 * xq (llama.cpp's q8_1), xs[h] = the sum of
// the half's float activations (for the offsets)
HD float chunk_dot(const Chunk& k, const int* xq, float d8, const float* xs) {
    int s0 = 0, s1 = 0;
    for (int i = 0; i < 4; ++i) s0 = dp4a(k.q[i], xq[i], s0);
    for (int i = 4; i < 8; ++i) s1 = dp4a(k.q[i], xq[i], s1);
    return d8 * (k.d[0] * (float)s0 + k.d[1] * (float)s1) + k.m[0] * xs[0] + k.m[1] * xs[1];
}
