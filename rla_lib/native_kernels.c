/* Kernel-order FP32 math of the training side outside the aligned layer, in C for speed: torch's BF16 GEMM without BF16
 * instructions, torch's for-loop AdamW and its 2-norm of BF16 gradients. Every operation here is the one torch
 * performs, in the same order, so the bits are the same (tested): compiled with -ffp-contract=off (no multiply-add
 * fused unless written as fmaf) and without -ffast-math (no reassociation). */
#include "align/vector.h"

/* torch's BF16 matrix product on a CPU without BF16 instructions or oneDNN's BF16 GEMM (aten's cpublas gemm_transa_:
 * one dot_with_fp32_arith per output, ReducedPrecisionFloatGemvFastPathKernel.cpp, AVX2 build), the linear vLLM-CPU's
 * `_C_AVX2` build calls. Output (m, n) sums the exact products x[m, k]·w[n, k] by fused multiply-adds: k = 64i + 8r + l
 * into register r's lane l, i in order; the 8 registers paired down (r + 4, then + 2, then + 1), then the lanes as
 * AVX2's vec_reduce_all pairs them (l ^ 4, then l ^ 2, then l ^ 1). Past the last whole 64: 16 at a time into one more
 * register (low 8 products, then high 8), paired down alike and added; the rest one product at a time.
 * Here each of the 64 (r, l) chains is computed for a tile of DOT_MR x DOT_NR outputs at once (their lanes hold
 * outputs, not products), from packed FP32 copies (`pack_dot_operand`): xw (M / DOT_MR, 64, I, DOT_MR) and ww
 * (N / DOT_NR, 64, I, DOT_NR) hold x[m, 64i + s] and w[n, 64i + s] for the I whole steps; the rest of K, T = K - 64I
 * columns, comes as x_tail (M, T) and w_tail (T, N). M is a multiple of DOT_MR, N of DOT_NR; rows [begin, end) of
 * out (M, N) are written in FP32, before rounding. */
enum { DOT_MR = 6, DOT_NR = 16, DOT_STEP = 64, DOT_TAIL = 16, DOT_LANES = 8, DOT_ROWS = 48 };

/* acc[r][c] = fma(x[r, k], w[k, c], acc[r][c]) for k = 0 .. count - 1 in order (from acc = 0 if `from_zero`), x[r, k]
 * at xs[k * xk + r * xr] and w[k, c] at ws[k * wk + c]. */
static void dot_chains(const float *xs, int64_t xk, int64_t xr, const float *ws, int64_t wk, int64_t count,
                       int from_zero, float acc[DOT_MR][DOT_NR]) {
    vec a[DOT_MR][DOT_NR / W];
    for (int r = 0; r < DOT_MR; r++)
        for (int c = 0; c < DOT_NR / W; c++) a[r][c] = from_zero ? vzero() : vload(&acc[r][c * W]);
    for (int64_t k = 0; k < count; k++, xs += xk, ws += wk)
        for (int r = 0; r < DOT_MR; r++) {
            const vec xv = vbroadcast(xs[r * xr]);
            for (int c = 0; c < DOT_NR / W; c++) a[r][c] = vfma(xv, vload(ws + c * W), a[r][c]);
        }
    for (int r = 0; r < DOT_MR; r++)
        for (int c = 0; c < DOT_NR / W; c++) vstore(&acc[r][c * W], a[r][c]);
}

/* out = lanes 0..7 of v (one register per output) summed as AVX2's vec_reduce_all pairs them: l ^ 4, l ^ 2, l ^ 1. */
static void lanes_reduce(float v[][DOT_MR][DOT_NR], float out[DOT_MR][DOT_NR]) {
    float a[DOT_LANES][DOT_MR][DOT_NR], b[2][DOT_MR][DOT_NR];
    for (int l = 0; l < DOT_LANES; l++)
        for (int r = 0; r < DOT_MR; r++)
            for (int c = 0; c < DOT_NR; c++) a[l][r][c] = v[l][r][c] + v[l ^ 4][r][c];
    for (int l = 0; l < 2; l++)
        for (int r = 0; r < DOT_MR; r++)
            for (int c = 0; c < DOT_NR; c++) b[l][r][c] = a[l][r][c] + a[l ^ 2][r][c];
    for (int r = 0; r < DOT_MR; r++)
        for (int c = 0; c < DOT_NR; c++) out[r][c] = b[0][r][c] + b[1][r][c];
}

static void dot_tile(const float *xw, const float *ww, const float *x_tail, const float *w_tail, int64_t steps,
                     int64_t T, int64_t N, int64_t m0, int64_t n0, float *out) {
    const int64_t vectors = T / DOT_TAIL * DOT_TAIL;
    float slots[DOT_STEP][DOT_MR][DOT_NR], tail[DOT_LANES][DOT_MR][DOT_NR], sums[DOT_MR][DOT_NR];
    for (int s = 0; s < DOT_STEP; s++)
        dot_chains(xw + s * steps * DOT_MR, DOT_MR, 1, ww + s * steps * DOT_NR, DOT_NR, steps, 1, slots[s]);
    if (vectors > 0)
        for (int l = 0; l < DOT_LANES; l++)  /* the 16-wide part of the tail: lane l takes its k = l, 8 + l, ... */
            dot_chains(x_tail + m0 * T + l, DOT_LANES, T, w_tail + l * N + n0, DOT_LANES * N, vectors / DOT_LANES, 1, tail[l]);
    /* the pairings, each over a tile's outputs at once (independent sums: free to vectorise); slot 8g + l is
     * register g's lane l */
    for (int half = 4; half >= 1; half /= 2)
        for (int g = 0; g < half; g++)
            for (int l = 0; l < DOT_LANES; l++)
                for (int r = 0; r < DOT_MR; r++)
                    for (int c = 0; c < DOT_NR; c++)
                        slots[g * DOT_LANES + l][r][c] = slots[g * DOT_LANES + l][r][c] + slots[(half + g) * DOT_LANES + l][r][c];
    lanes_reduce(slots, sums);
    if (vectors > 0)
        lanes_reduce(tail, tail[0]);
    for (int r = 0; r < DOT_MR; r++)  /* + 0 without a tail, as torch adds it (a -0 sum becomes +0) */
        for (int c = 0; c < DOT_NR; c++) sums[r][c] = sums[r][c] + (vectors > 0 ? tail[0][r][c] : 0.0f);
    if (T > vectors)  /* the last products, one at a time */
        dot_chains(x_tail + m0 * T + vectors, 1, T, w_tail + vectors * N + n0, N, T - vectors, 0, sums);
    for (int r = 0; r < DOT_MR; r++) memcpy(out + (m0 + r) * N + n0, sums[r], sizeof(sums[r]));
}

void torch_dot_linear(const float *xw, const float *ww, const float *x_tail, const float *w_tail, int64_t steps,
                      int64_t T, int64_t N, int64_t begin, int64_t end, float *out) {
    for (int64_t rows = begin; rows < end; rows += DOT_ROWS)  /* DOT_ROWS rows of x stay in cache across all of w */
        for (int64_t n0 = 0; n0 < N; n0 += DOT_NR)
            for (int64_t m0 = rows; m0 < end && m0 < rows + DOT_ROWS; m0 += DOT_MR)
                dot_tile(xw + m0 / DOT_MR * DOT_STEP * steps * DOT_MR, ww + n0 / DOT_NR * DOT_STEP * steps * DOT_NR,
                         x_tail, w_tail, steps, T, N, m0, n0, out);
}

/* packed[t][s][i][j] = a[t * tile + j, 64i + s] in FP32 (0 past the n rows) for tiles t in [begin, end), from BF16 a
 * (n, K): `torch_dot_linear`'s xw (tile DOT_MR) and ww (tile DOT_NR). */
void pack_dot_operand(const uint16_t *a, int64_t n, int64_t K, int64_t tile, int64_t begin, int64_t end, float *packed) {
    const int64_t steps = K / DOT_STEP;
    for (int64_t t = begin; t < end; t++)
        for (int64_t s = 0; s < DOT_STEP; s++)
            for (int64_t i = 0; i < steps; i++) {
                float *to = packed + ((t * DOT_STEP + s) * steps + i) * tile;
                for (int64_t j = 0; j < tile; j++) {
                    const int64_t row = t * tile + j;
                    to[j] = row < n ? bf16_value(a[row * K + i * DOT_STEP + s]) : 0.0f;
                }
            }
}

/* One AdamW step over [begin, end) of contiguous FP32 tensors, element by element as torch's for-loop AdamW computes it
 * (torch.optim.adam._single_tensor_adam, its CPU kernels' arithmetic), around torch's own sqrt (its vectorised sqrt
 * is not the correctly rounded one): in one pass calling that very function (adamw_step), else in two passes with
 * the caller running torch.sqrt between them.
 * Moments: lerp_ (torch's kernel fuses it: one fmaf), mul_ then addcmul_ (value·g, then a fused multiply-add). */
static inline void moments_at(int64_t i, float grad, float *m, float *v, int small, float coefficient, float beta2,
                              float one_minus_beta2) {
    m[i] = fmaf(coefficient, grad - m[i], small ? m[i] : grad);
    v[i] = fmaf(one_minus_beta2 * grad, grad, v[i] * beta2);
}

void adamw_moments(const float *g, float *m, float *v, int64_t begin, int64_t end, float lerp_weight, float beta2,
                   float one_minus_beta2) {
    const int small = fabsf(lerp_weight) < 0.5f;
    const float coefficient = small ? lerp_weight : lerp_weight - 1.0f;
    for (int64_t i = begin; i < end; i++)
        moments_at(i, g[i], m, v, small, coefficient, beta2, one_minus_beta2);
}

/* The same from BF16 gradients, each first multiplied by `scale` in FP32 (the gradient-norm clip's coefficient): the
 * bits of copying them into FP32 gradients, clipping those (mul_) and running `adamw_moments`, in one pass. */
void adamw_moments_bf16(const uint16_t *g, float scale, float *m, float *v, int64_t begin, int64_t end,
                        float lerp_weight, float beta2, float one_minus_beta2) {
    const int small = fabsf(lerp_weight) < 0.5f;
    const float coefficient = small ? lerp_weight : lerp_weight - 1.0f;
    for (int64_t i = begin; i < end; i++) {
        moments_at(i, bf16_value(g[i]) * scale, m, v, small, coefficient, beta2, one_minus_beta2);
    }
}

/* Then the parameters from the moments and root = sqrt(v): (root / bias correction) + eps, then addcdiv_
 * ((value·m) / denominator, then added). `decay` is 1 - lr·weight_decay (1: none, no multiply), applied first. */
static inline float parameter_at(float p, float m, float root, float decay, float bias_correction2_sqrt, float eps,
                                 float neg_step_size) {
    const float param = decay == 1.0f ? p : p * decay;
    return param + neg_step_size * m / (root / bias_correction2_sqrt + eps);
}

void adamw_parameters(float *p, const float *m, const float *root, int64_t begin, int64_t end, float decay,
                      float bias_correction2_sqrt, float eps, float neg_step_size) {
    for (int64_t i = begin; i < end; i++)
        p[i] = parameter_at(p[i], m[i], root[i], decay, bias_correction2_sqrt, eps, neg_step_size);
}

/* FP32 to BF16 as torch's vectorised copy rounds it: to nearest even, a NaN to 0xFFFF. */
static inline uint16_t bf16_nearest_even(float x) {
    union { float f; uint32_t u; } v = {x};
    return x != x ? 0xFFFFu : (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* torch's FP32 sqrt where it is MKL's: vmsSqrt(n, a, r, mode), taken from torch's own library (native.py checks its
 * bits against torch.sqrt before passing it), with MKL_Set_Num_Threads_Local: called from a thread of ours, MKL may
 * otherwise start threads of its own for each block (it did once a vLLM engine had started: 5x slower). */
typedef void (*vml_sqrt_fn)(int n, const float *a, float *r, long long mode);
typedef int (*mkl_threads_fn)(int threads);
enum { ADAMW_BLOCK = 2048 };  /* floats of a block's sqrt: the block stays in L1 between its three steps */

/* The whole step over [begin, end) in one pass over memory, a block at a time: the moments (as adamw_moments, from
 * FP32 gradients, or from BF16 ones times `scale` as adamw_moments_bf16), torch's sqrt of the block's second moments,
 * the parameters (as adamw_parameters) and, if `copy` is given, their BF16 rounding into it (the compute copy). */
void adamw_step(const void *g, int grad_is_bf16, float scale, float *p, float *m, float *v, uint16_t *copy,
                int64_t begin, int64_t end, float lerp_weight, float beta2, float one_minus_beta2, float decay,
                float bias_correction2_sqrt, float eps, float neg_step_size, vml_sqrt_fn vml_sqrt, long long mode,
                mkl_threads_fn mkl_threads_local) {
    const int threads_before = mkl_threads_local(1);
    float root[ADAMW_BLOCK];
    for (int64_t b = begin; b < end; b += ADAMW_BLOCK) {
        const int64_t e = end - b < ADAMW_BLOCK ? end : b + ADAMW_BLOCK;
        if (grad_is_bf16)
            adamw_moments_bf16((const uint16_t *)g, scale, m, v, b, e, lerp_weight, beta2, one_minus_beta2);
        else
            adamw_moments((const float *)g, m, v, b, e, lerp_weight, beta2, one_minus_beta2);
        vml_sqrt((int)(e - b), v + b, root, mode);
        for (int64_t i = b; i < e; i++)
            p[i] = parameter_at(p[i], m[i], root[i - b], decay, bias_correction2_sqrt, eps, neg_step_size);
        if (copy)
            for (int64_t i = b; i < e; i++)
                copy[i] = bf16_nearest_even(p[i]);
    }
    mkl_threads_local(threads_before);
}

/* The 2-norm of BF16 values widened to FP32, in the order of torch's 2-norm of a contiguous FP32 tensor (ATen's norm
 * kernel, its vectorised path over the last dimension): `lanes` running sums over the whole vectors, each adding x·x
 * (rounded, then added), the lanes then added to the first in order, the tail's squares after, then sqrt; one value's
 * norm is its magnitude. A BF16 value's square is exact unless it is subnormal, and there the tail's order shows: as
 * torch's build compiled it (`tail`: TAIL_ROUNDED, TAIL_FUSED, or TAIL_FOURS: squares rounded four at a time and added
 * in order, the last few fused into multiply-adds). native.py finds lanes and tail by comparing with torch. */
enum { TAIL_ROUNDED = 0, TAIL_FUSED = 1, TAIL_FOURS = 2 };

static inline float bf16_norm_in_order(const uint16_t *x, int64_t n, const int lanes, int tail) {
    if (n == 1)
        return fabsf(bf16_value(x[0]));
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + lanes <= n; d += lanes)
        for (int j = 0; j < lanes; j++)
            acc[j] = acc[j] + bf16_value(x[d + j]) * bf16_value(x[d + j]);
    float sum = acc[0];
    for (int j = 1; j < lanes; j++)
        sum = sum + acc[j];
    const int64_t rounded = tail == TAIL_ROUNDED ? n : tail == TAIL_FUSED ? d : d + (n - d) / 4 * 4;
    for (; d < rounded; d++)
        sum = sum + bf16_value(x[d]) * bf16_value(x[d]);
    for (; d < n; d++)
        sum = fmaf(bf16_value(x[d]), bf16_value(x[d]), sum);
    return sqrtf(sum);
}

float bf16_norm(const uint16_t *x, int64_t n, int64_t lanes, int64_t tail) {
    if (lanes == 16)
        return bf16_norm_in_order(x, n, 16, (int)tail);
    if (lanes == 8)
        return bf16_norm_in_order(x, n, 8, (int)tail);
    return NAN;
}
