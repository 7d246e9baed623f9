/* Kernel-order FP32 math of the aligned layer (rla_lib.align.vector_sums' Σx², rla_lib.align.attention's vLLM-CPU
 * attention), in C for speed. Every operation here is the one the torch-op version performs, in the same order, so
 * the bits are the same (tested): compiled with -ffp-contract=off (no multiply-add fused unless written as fmaf) and
 * without -ffast-math (no reassociation). Loops over independent lanes, rows and keys are free to vectorise; loops
 * that accumulate stay sequential. */
#include "vector.h"

/* Σx² of each row of x (rows, n), as inductor's vectorised reduction adds it: `registers` registers of `width` lanes
 * take the row in steps of registers·width elements (the square rounded, then added, per lane), the registers are
 * added in order, the lanes paired down (upper half onto lower half). vector_sums.square_sum. */
void square_sum(const float *x, int64_t rows, int64_t n, int64_t registers, int64_t width, float *out) {
    const int64_t step = registers * width;
    float acc[256], lanes[256];
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        for (int64_t j = 0; j < step; j++) {
            const float v = j < n ? row[j] : 0.0f;
            acc[j] = v * v;
        }
        for (int64_t i = step; i < n; i += step)
            for (int64_t j = 0; j < step; j++) {
                const float v = i + j < n ? row[i + j] : 0.0f;
                acc[j] = acc[j] + v * v;
            }
        for (int64_t j = 0; j < width; j++) lanes[j] = acc[j];
        for (int64_t k = 1; k < registers; k++)
            for (int64_t j = 0; j < width; j++) lanes[j] = lanes[j] + acc[k * width + j];
        for (int64_t half = width / 2; half >= 1; half /= 2)
            for (int64_t j = 0; j < half; j++) lanes[j] = lanes[half + j] + lanes[j];
        out[r] = lanes[0];
    }
}

/* vLLM's AVX-512 fast_exp (csrc/cpu/cpu_attn_macros.h), as attention.vllm_fast_exp; branch-free, so loops over it
 * vectorise (min/max and the select are exact, whatever instructions they become). */
static inline float fast_exp(float x) {
    const float log2e = 0x1.7154760000000p+0f, ln2 = 0x1.62e4300000000p-1f; /* bits 0x3FB8AA3B, 0x3F317218 */
    const float ln_flt_min = -0x1.5d58a00000000p+6f, ln_flt_max = 0x1.62e4300000000p+6f; /* 0xC2AEAC50, 0x42B17218 */
    const float clamped = x < ln_flt_max ? x : ln_flt_max;
    const float src = clamped > ln_flt_min ? clamped : ln_flt_min;
    const float fx = floorf(fmaf(src, log2e, 0.5f));
    const float r = fmaf(-fx, ln2, src);
    float poly = fmaf(r, (float)0.00828929059, (float)0.0418978221);
    poly = fmaf(r, poly, (float)0.166676521);
    poly = fmaf(r, poly, (float)0.499991506);
    poly = fmaf(r, poly, (float)0.999999701);
    poly = fmaf(r, poly, 1.0f);
    const union { uint32_t bits; float value; } two_n = {(uint32_t)((int32_t)(fx - 1.0f) + 127) << 23};
    return poly * (x < ln_flt_min ? 0.0f : two_n.value) * 2.0f;
}

enum { ROW_BLOCK = 8, LANES = 16 };

/* The two x86 builds of vLLM-CPU's vector attention kernel that have loops of their own (csrc/cpu/cpu_attn_impl.hpp, micro_gemm/cpu_micro_gemm_vec.hpp,
 * cpu_types_x86.hpp). Both write `c = c + a * b` and sum p in 16 lanes. Built for AVX-512 (`_C`), the compiler fuses
 * c + a·b into one FMA, exp is DEFINE_FAST_EXP's polynomial and the 16 lanes are reduced pairwise
 * (_mm512_reduce_add_ps). Built for AVX2 (`_C_AVX2`, compiled with -mavx2 and no -mfma), a·b is rounded before the add,
 * exp is the C library's expf (std::exp per element) and the 16 lanes, two 8-lane halves, are each summed in order
 * and the two sums added. */
enum { ISA_AVX512 = 0, ISA_AVX2 = 1, ISA_AMX = 2 };

/* The AMX kernel (cpu_attn_amx.hpp, in `_C`) shares the AVX-512 softmax but multiplies on AMX tiles: q is kept in
 * BF16 and the scale multiplies the logits instead, and P is stored in BF16 (rounded to nearest) for P·V while the
 * row sum adds the FP32 values. One TDPBF16PS takes AMX_K = 32 BF16 products per output; measured on an Intel Xeon
 * (family 6 model 207) against every other order tried, it sums the even-numbered products in order into one FP32
 * value and the odd-numbered into another, both from zero, and adds their sum to the accumulator (the ISA_AMX loops below). The
 * products of two BF16 numbers are exact in FP32, so each in-order step is an FMA with that product. */
enum { AMX_K = 32 };
static inline float bf16_nearest(float x) {
    union { float f; uint32_t u; } v = {x};
    v.u = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) & 0xFFFF0000u; /* finite inputs: p is in [0, 1] */
    return v.f;
}

static float lane_sum(const float *lanes, int64_t isa) {
    if (isa == ISA_AVX2) {
        float low = 0.0f, high = 0.0f;
        for (int64_t j = 0; j < LANES / 2; j++) low = low + lanes[j];
        for (int64_t j = LANES / 2; j < LANES; j++) high = high + lanes[j];
        return low + high;
    }
    float pairs[LANES];
    memcpy(pairs, lanes, sizeof(pairs));
    for (int64_t half = LANES / 2; half >= 1; half /= 2)
        for (int64_t j = 0; j < half; j++) pairs[j] = pairs[half + j] + pairs[j];
    return pairs[0];
}

static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Each row of attended (rows, S) bytes: its first attended key and last + 1 into span (rows, 2); (S, S) where none. */
void attention_spans(const uint8_t *attended, int64_t rows, int64_t S, int64_t *span) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *m = attended + r * S;
        int64_t lo = 0, hi = S;
        while (lo < S && !m[lo]) lo++;
        while (hi > lo && !m[hi - 1]) hi--;
        span[2 * r] = lo;
        span[2 * r + 1] = lo == S ? S : hi;
    }
}

/* One query row's softmax over keys [lo, hi) as vLLM's prefill/decode loop runs it when the keys come in KV tiles of
 * `tile` keys counted from the sequence's first key `origin` (cpu_attn_impl.hpp: the compute loop over kv_tile_pos,
 * apply_softmax): the running max starts at -FLT_MAX and moves to a tile's max only when that is more than 8 above it
 * (the lazy rescale), each tile's p = exp(s - max) is summed in 16 lanes restarting at the tile's first key, and the
 * row sum becomes tile sum + f·sum (f = exp(old max - new max) where the max moved; multiply and add apart in the
 * AVX2 build, fused in the others), the partial output being multiplied by f before the tile's P·V. Writes p over
 * row[lo, hi), rescale[s] = f at the first key s of each tile after the first where the max moved, the row's max and
 * sum. Keys a row does not attend score -inf: a tile of them changes nothing (p = 0, the max stays). */
static void tiled_row_softmax(float *row, int64_t lo, int64_t hi, int64_t origin, int64_t tile, int64_t isa,
                              float *rescale, float *row_max, float *row_sum) {
    float max = -FLT_MAX, sum = 0.0f;
    int first = 1;
    for (int64_t tl = origin + (lo - origin) / tile * tile; tl < hi; tl += tile) {
        const int64_t a = tl > lo ? tl : lo, b = tl + tile < hi ? tl + tile : hi;
        float tile_max = max;
        for (int64_t s = a; s < b; s++) tile_max = row[s] > tile_max ? row[s] : tile_max;
        const float moved = max - tile_max;
        const int rescaled = moved < -8.0f;
        float f = 1.0f;
        if (rescaled) max = tile_max, f = expf(moved);
        for (int64_t s = a; s < b; s++) row[s] = isa == ISA_AVX2 ? expf(row[s] - max) : fast_exp(row[s] - max);
        float lanes[LANES] = {0};
        for (int64_t s = a; s < b; s++) lanes[(s - tl) % LANES] = lanes[(s - tl) % LANES] + row[s];
        const float tile_sum = lane_sum(lanes, isa);
        if (rescaled) {
            sum = isa == ISA_AVX2 ? tile_sum + f * sum : fmaf(f, sum, tile_sum);
            if (!first) rescale[a] = f;
        } else {
            sum = tile_sum + sum;
        }
        first = 0;
    }
    *row_max = max, *row_sum = sum;
}

/* vLLM's CPU attention forward for heads [bh_begin, bh_end) of q (B·H, T, D) (FP32, unscaled) and k, v
 * (B·KV, S, D) (FP32; query head h reads key/value head h / (H / KV)), attended (B, Hm, T, S) bytes (Hm is 1 or H),
 * span (B, Hm, T, 2) from attention_spans, start (B): each sequence's first key position (the origin of the row sum's
 * 16 lanes). Writes out (B·H, T, D) = (1/Σp)·Σ p·v before rounding, logsumexp (B·H, T) = max + log Σp and,
 * unless p_out is NULL, p_out (B·H, T, S) = p/Σp.
 * `isa` is the kernel reproduced (ISA_AVX512, ISA_AVX2: lane_sum; ISA_AMX: bf16_nearest), `scale` the softmax scale.
 * As attention._vllm_cpu_forward: q·kᵀ and P·V as sequential multiply-add chains, keys outside a row's attended span
 * skipped (their p is 0: adding 0 or fmaf(0, v, acc) leaves every partial sum's bits as they are). Blocks of 8
 * query rows and W keys (or W output dims) accumulate in registers: the chains' order is the same, interleaved. */
int vllm_cpu_attention(const float *q, const float *k, const float *v, const uint8_t *attended, const int64_t *span,
                       const int64_t *start, const int64_t *tiles, int64_t H, int64_t KV, int64_t Hm, int64_t T,
                       int64_t S, int64_t D, int64_t bh_begin, int64_t bh_end, int64_t isa, float scale, float *out,
                       float *logsumexp, float *p_out) {
    const int64_t S16 = round_up(S, LANES), D16 = round_up(D, LANES), stride = S16 + 2 * LANES;
    float *scores = malloc(sizeof(float) * ROW_BLOCK * stride), *qb = malloc(sizeof(float) * ROW_BLOCK * D);
    /* the current key/value head: keys transposed (D, S16), values (S, D16), zero-padded to whole vectors */
    float *kh = calloc(D * S16, sizeof(float)), *vh = calloc(S * D16, sizeof(float));
    /* tiled rows (tiles != NULL): each row's output rescale factor at a tile's first key (1: none), and which keys
     * start a rescale for some row of the block */
    float *rescale = malloc(sizeof(float) * ROW_BLOCK * S);
    uint8_t *marks = malloc(S ? S : 1);
    if (!scores || !qb || !kh || !vh || !rescale || !marks) {
        free(scores), free(qb), free(kh), free(vh), free(rescale), free(marks);
        return 1;
    }
    int64_t loaded = -1;
    for (int64_t bh = bh_begin; bh < bh_end; bh++) {
        const int64_t b = bh / H, h = Hm == 1 ? 0 : bh % H, kv = b * KV + bh % H / (H / KV);
        if (kv != loaded) {
            for (int64_t s = 0; s < S; s++)
                for (int64_t d = 0; d < D; d++) {
                    kh[d * S16 + s] = k[(kv * S + s) * D + d];
                    vh[s * D16 + d] = v[(kv * S + s) * D + d];
                }
            loaded = kv;
        }
        const float *qh = q + bh * T * D;
        const uint8_t *mh = attended + (b * Hm + h) * T * S;
        for (int64_t t0 = 0; t0 < T; t0 += ROW_BLOCK) {
            const int64_t rows = T - t0 < ROW_BLOCK ? T - t0 : ROW_BLOCK;
            const int64_t *lo = span + ((b * Hm + h) * T + t0) * 2, *hi = lo + 1; /* lo[2 * i], hi[2 * i] */
            int64_t block_lo = S, block_hi = 0;
            for (int64_t i = 0; i < rows; i++) {
                if (lo[2 * i] < block_lo) block_lo = lo[2 * i];
                if (hi[2 * i] > block_hi) block_hi = hi[2 * i];
            }
            memset(qb, 0, sizeof(float) * ROW_BLOCK * D);
            /* the vector kernels scale q in FP32 while copying it to their buffer; the AMX one scales the logits */
            for (int64_t j = 0; j < rows * D; j++) qb[j] = isa == ISA_AMX ? qh[t0 * D + j] : qh[t0 * D + j] * scale;
            /* q·kᵀ: one fused multiply-add per head dimension, in order (8 rows × W keys in registers) */
            for (int64_t s0 = block_lo / W * W; s0 < block_hi; s0 += W) {
                vec a[ROW_BLOCK];
#pragma GCC unroll 8
                for (int64_t i = 0; i < ROW_BLOCK; i++) a[i] = vzero();
                if (isa == ISA_AMX)
                    for (int64_t d0 = 0; d0 < D; d0 += AMX_K) { /* one TDPBF16PS per AMX_K head dimensions */
                        vec even[ROW_BLOCK], odd[ROW_BLOCK];
                        for (int64_t i = 0; i < ROW_BLOCK; i++) even[i] = odd[i] = vzero();
                        for (int64_t d = d0; d < D && d < d0 + AMX_K; d++) {
                            const vec k = vload(kh + d * S16 + s0);
                            for (int64_t i = 0; i < ROW_BLOCK; i++) {
                                vec *part = (d - d0) % 2 ? &odd[i] : &even[i];
                                *part = vfma(vbroadcast(qb[i * D + d]), k, *part);
                            }
                        }
                        for (int64_t i = 0; i < ROW_BLOCK; i++) a[i] = vadd(a[i], vadd(even[i], odd[i]));
                    }
                else
                    for (int64_t d = 0; d < D; d++) {
                        const vec k = vload(kh + d * S16 + s0);
#pragma GCC unroll 8
                        for (int64_t i = 0; i < ROW_BLOCK; i++)
                            a[i] = isa == ISA_AVX2 ? vmuladd(vbroadcast(qb[i * D + d]), k, a[i])
                                                   : vfma(vbroadcast(qb[i * D + d]), k, a[i]);
                    }
#pragma GCC unroll 8
                for (int64_t i = 0; i < ROW_BLOCK; i++) vstore(scores + i * stride + LANES + s0, a[i]);
                if (isa == ISA_AMX)
                    for (int64_t i = 0; i < ROW_BLOCK; i++)
                        for (int64_t j = 0; j < W; j++) scores[i * stride + LANES + s0 + j] *= scale;
            }
            float inverse[ROW_BLOCK];
            /* the row sum's lanes count from start[b]: whole 16-key groups from there, zeros around the block */
            const int64_t group_lo = start[b] + (block_lo - start[b]) / LANES * LANES;
            const int64_t group_hi = block_hi + (LANES - (block_hi - start[b]) % LANES) % LANES;
            int tiled = 0;
            for (int64_t i = 0; i < rows; i++) {
                const uint8_t *m = mh + (t0 + i) * S;
                float *row = scores + i * stride + LANES; /* the buffer has 16 floats of room on either side */
                /* masked keys score -inf: excluded from the max, and both exps give exactly 0 there */
                for (int64_t s = block_lo; s < block_hi; s++)
                    row[s] = s >= lo[2 * i] && s < hi[2 * i] && m[s] ? row[s] : -INFINITY;
                const int64_t tile = tiles ? tiles[b * T + t0 + i] : 0;
                if (tile > 0 && lo[2 * i] < hi[2 * i]) { /* the keys in KV tiles, the max moving lazily */
                    if (!tiled)
                        for (int64_t j = 0; j < ROW_BLOCK * S; j++) rescale[j] = 1.0f;
                    if (!tiled) memset(marks, 0, S);
                    tiled = 1;
                    float row_max, row_sum;
                    tiled_row_softmax(row, lo[2 * i], hi[2 * i], start[b], tile, isa, rescale + i * S, &row_max, &row_sum);
                    for (int64_t s = block_lo; s < lo[2 * i]; s++) row[s] = 0.0f;
                    for (int64_t s = hi[2 * i]; s < block_hi; s++) row[s] = 0.0f;
                    for (int64_t s = lo[2 * i]; s < hi[2 * i]; s++) marks[s] |= rescale[i * S + s] != 1.0f;
                    inverse[i] = 1.0f / row_sum;
                    logsumexp[bh * T + t0 + i] = row_max + logf(row_sum);
                    continue;
                }
                vec maxima = vbroadcast(-INFINITY);
                int64_t s = block_lo;
                for (; s + W <= block_hi; s += W) maxima = vmax(maxima, vload(row + s));
                float row_max = -INFINITY, lanes_max[W];
                vstore(lanes_max, maxima);
                for (int64_t j = 0; j < W; j++) row_max = lanes_max[j] > row_max ? lanes_max[j] : row_max;
                for (; s < block_hi; s++) row_max = row[s] > row_max ? row[s] : row_max;
                if (!isfinite(row_max)) row_max = 0.0f; /* a row that attends to nothing */
                if (isa == ISA_AVX2)
                    for (int64_t s = block_lo; s < block_hi; s++) row[s] = expf(row[s] - row_max);
                else
                    for (int64_t s = block_lo; s < block_hi; s++) row[s] = fast_exp(row[s] - row_max);
                for (int64_t s = group_lo; s < block_lo; s++) row[s] = 0.0f;
                for (int64_t s = block_hi; s < group_hi; s++) row[s] = 0.0f;
                float lanes[LANES] = {0};
                for (int64_t s = group_lo; s < group_hi; s += LANES)
                    for (int64_t j = 0; j < LANES; j++) lanes[j] = lanes[j] + row[s + j];
                const float row_sum = lane_sum(lanes, isa);
                inverse[i] = (float)(1.0 / (double)row_sum);
                /* for the backward: +inf where the row attends to nothing (no gradient) */
                logsumexp[bh * T + t0 + i] = row_sum > 0.0f ? row_max + logf(row_sum) : INFINITY;
            }
            for (int64_t i = rows; i < ROW_BLOCK; i++) /* rows past T: p = 0 */
                for (int64_t s = block_lo; s < block_hi; s++) scores[i * stride + LANES + s] = 0.0f;
            for (int64_t i = 0; i < rows && p_out; i++) {
                float *po = p_out + (bh * T + t0 + i) * S;
                const float *row = scores + i * stride + LANES;
                for (int64_t s = 0; s < S; s++) po[s] = (s >= block_lo && s < block_hi ? row[s] : 0.0f) * inverse[i];
            }
            if (isa == ISA_AMX) /* P·V reads P in BF16 (the row sums above added the FP32 values) */
                for (int64_t i = 0; i < ROW_BLOCK; i++)
                    for (int64_t s = block_lo; s < block_hi; s++)
                        scores[i * stride + LANES + s] = bf16_nearest(scores[i * stride + LANES + s]);
            /* P·V: one fused multiply-add per key, in order */
            for (int64_t d0 = 0; d0 < D16; d0 += W) { /* 8 rows × W dims in registers */
                vec a[ROW_BLOCK];
#pragma GCC unroll 8
                for (int64_t i = 0; i < ROW_BLOCK; i++) a[i] = vzero();
                if (isa == ISA_AMX) /* one TDPBF16PS per AMX_K keys, counted from the sequence's first key */
                    for (int64_t c0 = start[b] + (block_lo - start[b]) / AMX_K * AMX_K; c0 < block_hi; c0 += AMX_K) {
                        vec even[ROW_BLOCK], odd[ROW_BLOCK];
                        for (int64_t i = 0; i < ROW_BLOCK; i++) even[i] = odd[i] = vzero();
                        for (int64_t s = c0 > block_lo ? c0 : block_lo; s < block_hi && s < c0 + AMX_K; s++) {
                            const vec vs = vload(vh + s * D16 + d0);
                            for (int64_t i = 0; i < ROW_BLOCK; i++) {
                                vec *part = (s - c0) % 2 ? &odd[i] : &even[i];
                                *part = vfma(vbroadcast(scores[i * stride + LANES + s]), vs, *part);
                            }
                        }
                        for (int64_t i = 0; i < ROW_BLOCK; i++) a[i] = vadd(a[i], vadd(even[i], odd[i]));
                    }
                else
                    for (int64_t s = block_lo; s < block_hi; s++) {
                        const vec vs = vload(vh + s * D16 + d0);
                        if (tiled && marks[s]) /* a tile whose max moved: the partial outputs rescaled first */
                            for (int64_t i = 0; i < rows; i++) a[i] = vmul(a[i], vbroadcast(rescale[i * S + s]));
#pragma GCC unroll 8
                        for (int64_t i = 0; i < ROW_BLOCK; i++)
                            a[i] = isa == ISA_AVX2 ? vmuladd(vbroadcast(scores[i * stride + LANES + s]), vs, a[i])
                                                   : vfma(vbroadcast(scores[i * stride + LANES + s]), vs, a[i]);
                    }
                float lanes[ROW_BLOCK][W];
#pragma GCC unroll 8
                for (int64_t i = 0; i < ROW_BLOCK; i++) vstore(lanes[i], a[i]);
                for (int64_t i = 0; i < rows; i++)
                    for (int64_t j = 0; j < W && d0 + j < D; j++)
                        out[(bh * T + t0 + i) * D + d0 + j] = inverse[i] * lanes[i][j];
            }
        }
    }
    free(scores), free(qb), free(kh), free(vh), free(rescale), free(marks);
    return 0;
}
