// Products with quantized weights (raw GGUF blocks, see quants.cuh):
//  - quantize_q8: activations to int8 per 32 (llama.cpp's q8_1), for the dp4a dot products;
//  - mmvq_<type>: y = x @ W.T for a few tokens (decode), one warp per weight row, each lane a
//    32-weight chunk; epilogues fuse the residual add (MUL_MAT_ADD) and the gated activation
//    of two weights (FFN_GLU), so a decode FFN reads x once and writes one result;
//  - dequant_<type>: rows to float32, for get_rows and for cuBLAS on bigger batches.
#include "quants.cuh"

#define MAX_TOKENS 8  // mmvq's accumulators live in registers; larger batches go to cuBLAS
#define ROWS_PER_BLOCK 4

// x (n_chunks_total * 32) float -> xq int8, xd (n_chunks_total) scale, xs (2 per chunk) half sums.
// One warp per chunk, one lane per value. blockDim (32, ROWS_PER_BLOCK).
extern "C" __global__ void quantize_q8(const float* __restrict__ x, long long n_chunks_total, i8* __restrict__ xq,
                                       float* __restrict__ xd, float* __restrict__ xs) {
    long long c = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (c >= n_chunks_total) return;
    int lane = threadIdx.x;
    float v = x[c * 32 + lane];
    float amax = warp_max(fabsf(v));
    float s = v;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);  // within each half of 16
    float d = q8_scale(amax);  // 0 for a chunk of tiny values (FTZ-safe, see quants.cuh)
    xq[c * 32 + lane] = (i8)q8_code(v, d);
    if (lane == 0) xd[c] = d;
    if ((lane & 15) == 0) xs[c * 2 + lane / 16] = s;
}

__device__ __forceinline__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// mode 0: y = x @ W.T; 1: y = x @ W.T + r; 2: y = silu(x @ W.T) * (x @ W2.T); 3: gelu instead.
// W, W2 (n_rows, row_bytes); xq/xd/xs from quantize_q8 of x (n_tokens, n_chunks * 32); y, r
// (n_tokens, n_rows). blockDim (32, ROWS_PER_BLOCK), grid ceil(n_rows / ROWS_PER_BLOCK).
template <int T>
__device__ void mmvq(const u8* __restrict__ W, const u8* __restrict__ W2, long long row_bytes, int n_rows,
                     int n_chunks, const i8* __restrict__ xq, const float* __restrict__ xd,
                     const float* __restrict__ xs, int n_tokens, const float* __restrict__ r,
                     float* __restrict__ y, int mode) {
    int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= n_rows) return;  // the whole warp leaves together
    int lane = threadIdx.x;
    const bool two = mode >= 2;
    float acc[MAX_TOKENS], acc2[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) acc[t] = acc2[t] = 0.0f;
    const u8* w = W + row * row_bytes;
    const u8* w2 = W2 + row * row_bytes;
    for (int c = lane; c < n_chunks; c += 32) {
        Chunk k, k2;
        unpack<T>(w, c, k);
        if (two) unpack<T>(w2, c, k2);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t < n_tokens) {
                long long tc = (long long)t * n_chunks + c;
                const int4* p = (const int4*)(xq + tc * 32);  // 32 bytes, 16-byte aligned
                int4 a = p[0], b = p[1];
                int q[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                acc[t] += chunk_dot(k, q, xd[tc], xs + tc * 2);
                if (two) acc2[t] += chunk_dot(k2, q, xd[tc], xs + tc * 2);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < n_tokens) {
            float v = warp_sum(acc[t]);
            if (two) {
                float u = warp_sum(acc2[t]);
                v = (mode == 2 ? v / (1.0f + expf(-v)) : gelu_f(v)) * u;
            }
            if (lane == 0) {
                long long o = (long long)t * n_rows + row;
                y[o] = mode == 1 ? v + r[o] : v;
            }
        }
    }
}

// rows ids[i] (or row0 + i when ids is unused, use_ids = 0) of W to float32 out (n_out, n_chunks * 32).
// One thread per chunk.
template <int T>
__device__ void dequant(const u8* __restrict__ W, long long row_bytes, int n_chunks, const int* __restrict__ ids,
                        int use_ids, long long row0, long long n_out, float* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out * n_chunks) return;
    long long r = i / n_chunks;
    int c = (int)(i % n_chunks);
    long long src = use_ids ? (long long)ids[r] : row0 + r;
    Chunk k;
    unpack<T>(W + src * row_bytes, c, k);
    float4* o = (float4*)(out + r * n_chunks * 32 + c * 32);
#pragma unroll
    for (int j = 0; j < 8; ++j)
        o[j] = make_float4(chunk_weight(k, 4 * j), chunk_weight(k, 4 * j + 1), chunk_weight(k, 4 * j + 2),
                           chunk_weight(k, 4 * j + 3));
}

#define INSTANTIATE(T, name)                                                                                  \
    extern "C" __global__ void mmvq_##name(const u8* W, const u8* W2, long long row_bytes, int n_rows,        \
                                           int n_chunks, const i8* xq, const float* xd, const float* xs,      \
                                           int n_tokens, const float* r, float* y, int mode) {                \
        mmvq<T>(W, W2, row_bytes, n_rows, n_chunks, xq, xd, xs, n_tokens, r, y, mode);                        \
    }                                                                                                         \
    extern "C" __global__ void dequant_##name(const u8* W, long long row_bytes, int n_chunks, const int* ids, \
                                              int use_ids, long long row0, long long n_out, float* out) {     \
        dequant<T>(W, row_bytes, n_chunks, ids, use_ids, row0, n_out, out);                                   \
    }

INSTANTIATE(Q4_0, q4_0)
INSTANTIATE(Q4_1, q4_1)
INSTANTIATE(Q5_0, q5_0)
INSTANTIATE(Q5_1, q5_1)
INSTANTIATE(Q8_0, q8_0)
INSTANTIATE(Q2_K, q2_k)
INSTANTIATE(Q3_K, q3_k)
INSTANTIATE(Q4_K, q4_k)
INSTANTIATE(Q5_K, q5_k)
INSTANTIATE(Q6_K, q6_k)
