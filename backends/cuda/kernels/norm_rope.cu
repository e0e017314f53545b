// Row-wise and elementwise kernels: RMSNorm (+ weight, + residual), the gated activations
// (SwiGLU, GeGLU; plain SiLU/GELU with no gate), and RoPE (normal and NEOX), optionally
// writing the rotated rows straight into the KV cache. All float32, contiguous.
#include "common.cuh"

// y = x / sqrt(mean(x^2) + eps) [* w] [+ r] per row of n; one block per row, blockDim 256.
// has_w / has_r say whether w (n,) and r (like x) are real (else dummies).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    const float* __restrict__ r, float* __restrict__ y, int n, float eps,
                                    int has_w, int has_r) {
    __shared__ float part[32];
    long long base = (long long)blockIdx.x * n;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[base + i];
        s += v * v;
    }
    s = warp_sum(s);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    s = lane < n_warps ? part[lane] : 0.0f;
    s = warp_sum(s);  // every warp sums the partials: no second barrier
    float scale = 1.0f / sqrtf(s / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[base + i] * scale;
        if (has_w) v *= w[i];
        if (has_r) v += r[base + i];
        y[base + i] = v;
    }
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float gelu_f(float x) {  // tanh approximation, as ggml_gelu
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// y = act(g) [* u]; act 0 = silu, 1 = gelu, 2 = gpt-oss's clamped SwiGLU (alpha, limit; needs u).
// has_u 0: plain activation (u a dummy).
extern "C" __global__ void glu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                               long long n, int act, int has_u, float alpha, float limit) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (act == 2) {
        float x = fminf(g[i], limit);
        y[i] = x / (1.0f + expf(-alpha * x)) * (fminf(fmaxf(u[i], -limit), limit) + 1.0f);
        return;
    }
    float v = act == 0 ? silu_f(g[i]) : gelu_f(g[i]);
    y[i] = has_u ? v * u[i] : v;
}

// x (n_tokens, n_heads, head_dim); one thread per pair of dims. The first n_rot dims of each
// head rotate by pos * freq_scale * base^(-2i / n_rot) (in double, as the reference); the rest
// copy. Output row of token t: slots[t] when use_slots (the KV-cache write), else t.
extern "C" __global__ void rope(const float* __restrict__ x, const int* __restrict__ pos,
                                const int* __restrict__ slots, float* __restrict__ y, int n_tokens, int n_heads,
                                int head_dim, int n_rot, double base, double freq_scale, int neox, int use_slots,
                                const double* __restrict__ freqs, int use_freqs, double mscale) {
    int half_dim = head_dim / 2, half = n_rot / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_tokens * n_heads * half_dim) return;
    int i = (int)(idx % half_dim);
    long long th = idx / half_dim;  // token * n_heads + head
    int t = (int)(th / n_heads), h = (int)(th % n_heads);
    const float* xr = x + th * head_dim;
    long long out_row = use_slots ? (long long)slots[t] : (long long)t;
    float* yr = y + (out_row * n_heads + h) * head_dim;
    if (i >= half) {  // pass-through dims n_rot .. head_dim, two per thread
        int j = n_rot + 2 * (i - half);
        yr[j] = xr[j];
        yr[j + 1] = xr[j + 1];
        return;
    }
    // scaled RoPE (YaRN, Llama 3, LongRoPE) comes as per-dimension frequencies and a magnitude
    double theta = use_freqs ? (double)pos[t] * freqs[i]
                             : freq_scale * (double)pos[t] * pow(base, -2.0 * (double)i / (double)n_rot);
    double s, c;
    sincos(theta, &s, &c);
    s *= mscale;
    c *= mscale;
    int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    double x0 = xr[i0], x1 = xr[i1];
    yr[i0] = (float)(x0 * c - x1 * s);
    yr[i1] = (float)(x0 * s + x1 * c);
}
