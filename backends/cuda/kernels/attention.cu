// Attention over the paged KV cache, fused (Op.ATTN): each query token attends to its own
// sequence's positions [pos - window + 1 (or 0), pos], read through the block table, with
// an online softmax (flash attention's running max and sum), so no score matrix is stored.
// The cache is float32, float16, or quantized blocks (kv_quants.cuh) read in place: 32 lanes, 32
// values of a block.
#include "common.cuh"
#include "kv_quants.cuh"

#define MAX_D 256            // head dims up to 256 (gemma3): 8 per lane in registers
#define PER_LANE (MAX_D / 32)

// value j of row `row` ((slot, head) of a cache of d values a row): KV 0 float32, KV_F16 float16
// (any d), else a block type's id
template <int KV>
__device__ __forceinline__ float kv_load(const void* __restrict__ c, long long row, int d, int j) {
    if constexpr (KV == 0) {
        return ((const float*)c)[row * d + j];
    } else if constexpr (KV == KV_F16) {
        return ld_f16((const u8*)c + (row * d + j) * 2);
    } else {
        const int bytes = KVBlock<KV>::bytes;
        return kv_value<KV>((const u8*)c + row * (d / 32 * bytes) + (j >> 5) * bytes, j & 31);
    }
}

// q (n_tokens, n_head, d); k_cache (n_slots, n_head_kv, d), v_cache (n_slots, n_head_kv, dv);
// block_table (n_seqs, mb); out (n_tokens, n_head, dv). One warp per (token, head): grid
// (n_tokens, ceil(n_head / blockDim.y)), blockDim (32, heads per block). Heads of one GQA group
// sit in one block, so their shared K/V rows come from L1. Lanes split the head dims: loads
// of a K/V row are coalesced, and a warp sum gives each score.
template <int KV>
__device__ void attn(const float* __restrict__ q, const void* __restrict__ k_cache, const void* __restrict__ v_cache,
                     const int* __restrict__ tok_seq, const int* __restrict__ tok_pos, const int* __restrict__ tok_lo,
                     const int* __restrict__ tok_hi, const int* __restrict__ block_table, int mb, int n_head,
                     int n_head_kv, int d, int dv, float scale, float softcap, float max_bias, int block_size,
                     const float* __restrict__ sinks, int has_sinks, float* __restrict__ out) {
    int t = blockIdx.x;
    int h = blockIdx.y * blockDim.y + threadIdx.y;
    if (h >= n_head) return;
    int lane = threadIdx.x;
    int hk = h / (n_head / n_head_kv);
    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        int j = i * 32 + lane;
        qr[i] = j < d ? q[((long long)t * n_head + h) * d + j] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    int lo = tok_lo[t], hi = tok_hi[t];  // graph.attn_bounds: causal or an encoder's whole sequence
    float slope = 0.0f;  // ALiBi (max_bias > 0): ggml's per-head slope, as graph.alibi_slopes
    if (max_bias > 0.0f) {
        int n2 = 1 << (31 - __clz(n_head));  // 2^floor(log2 n_head)
        float m0 = powf(2.0f, -max_bias / n2), m1 = powf(2.0f, -(max_bias / 2.0f) / n2);
        slope = h < n2 ? powf(m0, h + 1) : powf(m1, 2 * (h - n2) + 1);
    }
    int pos = tok_pos[t];
    const int* bt = block_table + (long long)tok_seq[t] * mb;
    float mx = bits_f32(0xff800000u), sum = 0.0f;  // -inf (no math.h under NVRTC)
    for (int p = lo; p <= hi; ++p) {
        long long row = ((long long)bt[p / block_size] * block_size + p % block_size) * n_head_kv + hk;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            int j = i * 32 + lane;
            if (j < d) s += qr[i] * kv_load<KV>(k_cache, row, d, j);
        }
        s = warp_sum(s);
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);  // Gemma 2's logit soft-capping
        if (max_bias > 0.0f) s += slope * (float)(-abs(p - pos));  // ggml's -|p - pos| mask times the slope
        float m_new = fmaxf(mx, s);
        float corr = expf(mx - m_new);  // 0 on the first key (mx = -inf)
        float e = expf(s - m_new);
        sum = sum * corr + e;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            int j = i * 32 + lane;
            if (j < dv) acc[i] = acc[i] * corr + e * kv_load<KV>(v_cache, row, dv, j);
        }
        mx = m_new;
    }
    if (has_sinks) {  // gpt-oss: the head's sink logit joins the denominator, with no value
        float s = sinks[h], m_new = fmaxf(mx, s), corr = expf(mx - m_new);
        sum = sum * corr + expf(s - m_new);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[i] *= corr;
    }
    float inv = 1.0f / sum;  // hi >= lo always: at least the token's own key
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        int j = i * 32 + lane;
        if (j < dv) out[((long long)t * n_head + h) * dv + j] = acc[i] * inv;
    }
}

extern "C" __global__ void attn_paged(const float* __restrict__ q, const float* __restrict__ k_cache,
                                      const float* __restrict__ v_cache, const int* __restrict__ tok_seq,
                                      const int* __restrict__ tok_pos, const int* __restrict__ tok_lo,
                                      const int* __restrict__ tok_hi, const int* __restrict__ block_table, int mb,
                                      int n_head, int n_head_kv, int d, int dv, float scale, float softcap,
                                      float max_bias, int block_size, const float* __restrict__ sinks, int has_sinks,
                                      float* __restrict__ out) {
    attn<0>(q, k_cache, v_cache, tok_seq, tok_pos, tok_lo, tok_hi, block_table, mb, n_head, n_head_kv, d, dv, scale,
            softcap, max_bias, block_size, sinks, has_sinks, out);
}

// a float16 cache (core.kv_types' "f16"), its halves as bytes: written by cupy's casts (ops.py)
extern "C" __global__ void attn_paged_f16(const float* __restrict__ q, const u8* __restrict__ k_cache,
                                          const u8* __restrict__ v_cache, const int* __restrict__ tok_seq,
                                          const int* __restrict__ tok_pos, const int* __restrict__ tok_lo,
                                          const int* __restrict__ tok_hi, const int* __restrict__ block_table,
                                          int mb, int n_head, int n_head_kv, int d, int dv, float scale,
                                          float softcap, float max_bias, int block_size,
                                          const float* __restrict__ sinks, int has_sinks, float* __restrict__ out) {
    attn<KV_F16>(q, k_cache, v_cache, tok_seq, tok_pos, tok_lo, tok_hi, block_table, mb, n_head, n_head_kv, d, dv,
                 scale, softcap, max_bias, block_size, sinks, has_sinks, out);
}

// src (n_rows, n_head_kv, d) float32 -> its blocks at cache rows slots[t]; one thread per block
template <int T>
__device__ void kv_store(const float* __restrict__ src, const int* __restrict__ slots, u8* __restrict__ cache,
                         int n_rows, int n_head_kv, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nb = d / 32;
    if (i >= (long long)n_rows * n_head_kv * nb) return;
    int b = (int)(i % nb);
    long long th = i / nb;  // row * n_head_kv + head
    long long dst = (long long)slots[th / n_head_kv] * n_head_kv + th % n_head_kv;
    kv_quantize<T>(src + th * d + b * 32, cache + (dst * nb + b) * KVBlock<T>::bytes);
}

// cache rows slots[t] (all heads) -> out (n_rows, n_head_kv, d) float32; one thread per block
template <int T>
__device__ void kv_dequant(const u8* __restrict__ cache, const int* __restrict__ slots, float* __restrict__ out,
                           long long n_rows, int n_head_kv, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nb = d / 32;
    if (i >= n_rows * n_head_kv * nb) return;
    int b = (int)(i % nb);
    long long th = i / nb;
    long long src = (long long)slots[th / n_head_kv] * n_head_kv + th % n_head_kv;
    const u8* blk = cache + (src * nb + b) * KVBlock<T>::bytes;
    for (int j = 0; j < 32; ++j) out[th * d + b * 32 + j] = kv_value<T>(blk, j);
}

#define INSTANTIATE(T, name)                                                                                  \
    extern "C" __global__ void attn_paged_##name(const float* q, const u8* k_cache, const u8* v_cache,       \
                                                 const int* tok_seq, const int* tok_pos, const int* tok_lo,  \
                                                 const int* tok_hi, const int* block_table, int mb,          \
                                                 int n_head, int n_head_kv, int d, int dv, float scale,      \
                                                 float softcap, float max_bias, int block_size,              \
                                                 const float* sinks, int has_sinks, float* out) {            \
        attn<T>(q, k_cache, v_cache, tok_seq, tok_pos, tok_lo, tok_hi, block_table, mb, n_head, n_head_kv, d,  \
                dv, scale, softcap, max_bias, block_size, sinks, has_sinks, out);                             \
    }                                                                                                         \
    extern "C" __global__ void kv_store_##name(const float* src, const int* slots, u8* cache, int n_rows,    \
                                               int n_head_kv, int d) {                                        \
        kv_store<T>(src, slots, cache, n_rows, n_head_kv, d);                                                 \
    }                                                                                                         \
    extern "C" __global__ void kv_dequant_##name(const u8* cache, const int* slots, float* out,              \
                                                 long long n_rows, int n_head_kv, int d) {                    \
        kv_dequant<T>(cache, slots, out, n_rows, n_head_kv, d);                                               \
    }

INSTANTIATE(KV_Q8_0, q8_0)
INSTANTIATE(KV_Q4_0, q4_0)
