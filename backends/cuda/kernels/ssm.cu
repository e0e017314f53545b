// The recurrent layers' kernels: the short causal convolution (SSM_CONV) and Mamba-2's selective
// scan (SSM_SCAN), over a batch of sequence rows. Row i runs its tokens [seq_off[i], seq_off[i+1])
// in order from state slot state_slot[i] and leaves the state after them there (in place); a row
// with no tokens leaves its slot alone. The caller zeroes y (padding tokens stay 0). All float32,
// contiguous. Where has_snap and snap[t] >= 0 (snap (n,)), the state after token t is also written
// to slot snap[t] (speculative verification rows: the state after each drafted position).
#include "common.cuh"

// state (S, km1, C), x (n, C), w (C, km1 + 1), y (n, C); grid (n_seqs, ceil(C / blockDim.x)).
// A thread per (row, channel) reads xx = [state (km1 rows); the row's tokens] where they lie, then
// keeps xx's last km1 rows: ascending, row r reads row n + r > r, not yet written.
extern "C" __global__ void ssm_conv(float* __restrict__ state, const float* __restrict__ x,
                                    const float* __restrict__ w, const int* __restrict__ seq_off,
                                    const int* __restrict__ state_slot, const int* __restrict__ snap,
                                    int has_snap, float* __restrict__ y, int n_ch, int km1) {
    const int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= n_ch) return;
    const int t0 = seq_off[i], n = seq_off[i + 1] - t0;
    float* s = state + (long long)state_slot[i] * km1 * n_ch + c;  // row r: s[r * n_ch]
    const float* xc = x + (long long)t0 * n_ch + c;                 // token t0 + j: xc[j * n_ch]
    const float* wc = w + (long long)c * (km1 + 1);
    for (int j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int k = 0; k <= km1; ++k) {
            const int r = j + k;
            acc += wc[k] * (r < km1 ? s[(long long)r * n_ch] : xc[(long long)(r - km1) * n_ch]);
        }
        y[(long long)(t0 + j) * n_ch + c] = acc;
        if (has_snap && snap[t0 + j] >= 0) {  // the state after token j: xx's rows j + 1 .. j + km1
            float* d = state + (long long)snap[t0 + j] * km1 * n_ch + c;
            for (int r = 0; r < km1; ++r) {
                const int q = j + 1 + r;
                d[(long long)r * n_ch] = q < km1 ? s[(long long)q * n_ch] : xc[(long long)(q - km1) * n_ch];
            }
        }
    }
    if (n > 0)
        for (int r = 0; r < km1; ++r) {
            const int q = n + r;
            s[(long long)r * n_ch] = q < km1 ? s[(long long)q * n_ch] : xc[(long long)(q - km1) * n_ch];
        }
}

#define SCAN_ROWS 4     // state rows (of P) per warp, held in registers
#define SCAN_MAX_N 256  // d_state: 32 lanes x SCAN_PER_LANE
#define SCAN_PER_LANE (SCAN_MAX_N / 32)

// state (S, H, P, N), x (n, H, P), dt (n, H), a (H,), b and c (n, G, N), y (n, H, P).
// grid (n_seqs, H, ceil(P / (SCAN_ROWS * blockDim.y))), block (32, warps): a warp keeps SCAN_ROWS
// rows of one head's state, lane l the entries n = l + 32 j. As ggml_compute_forward_ssm_scan_f32's
// Mamba-2 branch (one A per head): per token dt_sp = softplus(dt) (x itself above 20),
// state = state * exp(dt_sp * A[h]) + B * (x * dt_sp), y = state . C, with head h reading group
// h / (H / G) of B and C (ggml's repeat_interleave).
extern "C" __global__ void ssm_scan(float* __restrict__ state, const float* __restrict__ x,
                                    const float* __restrict__ dt, const float* __restrict__ a,
                                    const float* __restrict__ b, const float* __restrict__ c,
                                    const int* __restrict__ seq_off, const int* __restrict__ state_slot,
                                    const int* __restrict__ snap, int has_snap,
                                    float* __restrict__ y, int n_head, int d_head, int n_group, int d_state) {
    const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int p0 = (blockIdx.z * blockDim.y + threadIdx.y) * SCAN_ROWS;
    if (p0 >= d_head) return;  // a whole warp: no barrier below
    const int g = h / (n_head / n_group);
    const int t0 = seq_off[i], t1 = seq_off[i + 1];
    float* s = state + (((long long)state_slot[i] * n_head + h) * d_head + p0) * d_state;
    float st[SCAN_ROWS][SCAN_PER_LANE];
#pragma unroll
    for (int r = 0; r < SCAN_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < SCAN_PER_LANE; ++j) {
            const int n = lane + 32 * j;
            st[r][j] = p0 + r < d_head && n < d_state ? s[(long long)r * d_state + n] : 0.0f;
        }
    const float ah = a[h];
    for (int t = t0; t < t1; ++t) {
        const float v = dt[(long long)t * n_head + h];
        const float dt_sp = v > 20.0f ? v : log1pf(expf(v));
        const float da = expf(dt_sp * ah);
        const float* bt = b + ((long long)t * n_group + g) * d_state;
        const float* ct = c + ((long long)t * n_group + g) * d_state;
        float bv[SCAN_PER_LANE], cv[SCAN_PER_LANE];
#pragma unroll
        for (int j = 0; j < SCAN_PER_LANE; ++j) {
            const int n = lane + 32 * j;
            bv[j] = n < d_state ? bt[n] : 0.0f;  // 0 keeps the unused entries at 0
            cv[j] = n < d_state ? ct[n] : 0.0f;
        }
        const float* xt = x + ((long long)t * n_head + h) * d_head + p0;
        float* yt = y + ((long long)t * n_head + h) * d_head + p0;
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; ++r) {
            if (p0 + r >= d_head) break;  // warp-uniform
            const float x_dt = xt[r] * dt_sp;
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < SCAN_PER_LANE; ++j) {
                st[r][j] = st[r][j] * da + bv[j] * x_dt;
                acc += st[r][j] * cv[j];
            }
            acc = warp_sum(acc);
            if (lane == 0) yt[r] = acc;
        }
        if (has_snap && snap[t] >= 0) {  // this warp's rows of the state after token t
            float* d = state + (((long long)snap[t] * n_head + h) * d_head + p0) * d_state;
#pragma unroll
            for (int r = 0; r < SCAN_ROWS; ++r)
#pragma unroll
                for (int j = 0; j < SCAN_PER_LANE; ++j) {
                    const int n = lane + 32 * j;
                    if (p0 + r < d_head && n < d_state) d[(long long)r * d_state + n] = st[r][j];
                }
        }
    }
    if (t1 > t0)
#pragma unroll
        for (int r = 0; r < SCAN_ROWS; ++r)
#pragma unroll
            for (int j = 0; j < SCAN_PER_LANE; ++j) {
                const int n = lane + 32 * j;
                if (p0 + r < d_head && n < d_state) s[(long long)r * d_state + n] = st[r][j];
            }
}
