// The gated delta rule (Qwen3-Next / Qwen3.5 linear attention; ggml's GATED_DELTA_NET) over a
// batch of sequences, each run from its slot of the state cache and left there. Float32. Where
// has_snap and snap[t] >= 0, the state after token t is also written to slot snap[t] (speculative
// verification rows: the state after each drafted position).
#include "common.cuh"

#define GDN_MAX_KL 4   // columns per lane: d_k <= 128
#define GDN_MAX_RW 8   // rows per warp: d_v <= 8 * blockDim.y (16 warps: 128)

// One block per (sequence row i = blockIdx.x, v-head h = blockIdx.y), blockDim (32, n_warps).
// The rule keeps the state's rows (value dims) independent, so warp w owns rows w, w + n_warps,
// ... in registers for all of the row's tokens, lanes splitting d_k; each row's S k and S q are
// warp sums: no shared memory, no barrier. state (S, H_v, d_v, d_k); q, k (n, H_k, d_k);
// v, y (n, H_v, d_v); g, beta (n, H_v). y's padding tokens are the caller's (zeroed).
// __launch_bounds__: 512 threads need <= 128 registers each (it uses about 110)
extern "C" __global__ void __launch_bounds__(512)
gated_delta_net(float* __restrict__ state, const float* __restrict__ q, const float* __restrict__ k,
                const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
                const int* __restrict__ seq_off, const int* __restrict__ state_slot,
                const int* __restrict__ snap, int has_snap, float* __restrict__ y,
                int h_k, int h_v, int d_k, int d_v, float scale) {
    const int i = blockIdx.x, h = blockIdx.y;
    const int t0 = seq_off[i], t1 = seq_off[i + 1];
    if (t1 <= t0) return;  // no tokens: the slot is not touched (nor its index read)
    const int kh = h % h_k;  // tiled, as ggml (ops.cpp iq1 = iv1 % neq1, and its cuda kernel)
    const int lane = threadIdx.x, warp = threadIdx.y, n_warps = blockDim.y;
    float* sh = state + ((long long)state_slot[i] * h_v + h) * d_v * d_k;

    float s[GDN_MAX_RW][GDN_MAX_KL];
#pragma unroll
    for (int r = 0; r < GDN_MAX_RW; ++r) {
        const int row = warp + r * n_warps;
#pragma unroll
        for (int c = 0; c < GDN_MAX_KL; ++c) {
            const int col = lane + 32 * c;
            s[r][c] = row < d_v && col < d_k ? sh[(long long)row * d_k + col] : 0.0f;
        }
    }
    for (int t = t0; t < t1; ++t) {
        const long long tk = ((long long)t * h_k + kh) * d_k, tv = (long long)t * h_v + h;
        float kr[GDN_MAX_KL], qr[GDN_MAX_KL];
#pragma unroll
        for (int c = 0; c < GDN_MAX_KL; ++c) {
            const int col = lane + 32 * c;
            kr[c] = col < d_k ? k[tk + col] : 0.0f;
            qr[c] = col < d_k ? q[tk + col] : 0.0f;
        }
        const float a = expf(g[tv]), b = beta[tv];
#pragma unroll
        for (int r = 0; r < GDN_MAX_RW; ++r) {
            const int row = warp + r * n_warps;
            if (row < d_v) {  // the same for the whole warp: its shuffles stay converged
                float kv = 0.0f;
#pragma unroll
                for (int c = 0; c < GDN_MAX_KL; ++c) kv += s[r][c] * kr[c];
                const float delta = (v[tv * d_v + row] - a * warp_sum(kv)) * b;  // S k after the decay
                float o = 0.0f;
#pragma unroll
                for (int c = 0; c < GDN_MAX_KL; ++c) {
                    s[r][c] = a * s[r][c] + delta * kr[c];
                    o += s[r][c] * qr[c];
                }
                o = warp_sum(o);
                if (lane == 0) y[tv * d_v + row] = o * scale;
            }
        }
        if (has_snap && snap[t] >= 0) {  // this warp's rows of the state after token t
            float* d = state + ((long long)snap[t] * h_v + h) * d_v * d_k;
#pragma unroll
            for (int r = 0; r < GDN_MAX_RW; ++r) {
                const int row = warp + r * n_warps;
#pragma unroll
                for (int c = 0; c < GDN_MAX_KL; ++c) {
                    const int col = lane + 32 * c;
                    if (row < d_v && col < d_k) d[(long long)row * d_k + col] = s[r][c];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_MAX_RW; ++r) {
        const int row = warp + r * n_warps;
#pragma unroll
        for (int c = 0; c < GDN_MAX_KL; ++c) {
            const int col = lane + 32 * c;
            if (row < d_v && col < d_k) sh[(long long)row * d_k + col] = s[r][c];
        }
    }
}
