// Attention over the paged KV cache, fused (Op.ATTN): each query token attends to its own
// sequence's positions [pos - window + 1 (or 0), pos], read through the block table, with
// an online softmax (flash attention's running max and sum), so no score matrix is stored.
#include "common.cuh"

#define MAX_D 256            // head dims up to 256 (gemma3): 8 per lane in registers
#define PER_LANE (MAX_D / 32)

// q (n_tokens, n_head, d); k_cache (n_slots, n_head_kv, d), v_cache (n_slots, n_head_kv, dv);
// block_table (n_seqs, mb); out (n_tokens, n_head, dv). One warp per (token, head): grid
// (n_tokens, ceil(n_head / blockDim.y)), blockDim (32, heads per block). Heads of one GQA group
// sit in one block, so their shared K/V rows come from L1. Lanes split the head dims: loads
// of a K/V row are coalesced, and a warp sum gives each score.
extern "C" __global__ void attn_paged(const float* __restrict__ q, const float* __restrict__ k_cache,
                                      const float* __restrict__ v_cache, const int* __restrict__ tok_seq,
                                      const int* __restrict__ tok_lo, const int* __restrict__ tok_hi,
                                      const int* __restrict__ block_table, int mb, int n_head, int n_head_kv,
                                      int d, int dv, float scale, float softcap, int block_size,
                                      float* __restrict__ out) {
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
    const int* bt = block_table + (long long)tok_seq[t] * mb;
    float mx = bits_f32(0xff800000u), sum = 0.0f;  // -inf (no math.h under NVRTC)
    for (int p = lo; p <= hi; ++p) {
        long long slot = (long long)bt[p / block_size] * block_size + p % block_size;
        const float* kr = k_cache + (slot * n_head_kv + hk) * d;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            int j = i * 32 + lane;
            if (j < d) s += qr[i] * kr[j];
        }
        s = warp_sum(s);
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);  // Gemma 2's logit soft-capping
        float m_new = fmaxf(mx, s);
        float corr = expf(mx - m_new);  // 0 on the first key (mx = -inf)
        float e = expf(s - m_new);
        sum = sum * corr + e;
        const float* vr = v_cache + (slot * n_head_kv + hk) * dv;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            int j = i * 32 + lane;
            if (j < dv) acc[i] = acc[i] * corr + e * vr[j];
        }
        mx = m_new;
    }
    float inv = 1.0f / sum;  // hi >= lo always: at least the token's own key
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        int j = i * 32 + lane;
        if (j < dv) out[((long long)t * n_head + h) * dv + j] = acc[i] * inv;
    }
}
