/* What rla's C kernels share: BF16 values read exactly, and one vector register of W floats with its exact fused
 * multiply-add (a·b + c rounded once, per lane) and its multiply then add (a·b rounded, then the sum rounded:
 * -ffp-contract=off keeps them apart). Included by rla_lib/align/kernels.c and rla_lib/native_kernels.c. */
#ifndef RLA_VECTOR_H
#define RLA_VECTOR_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_value(uint16_t bits) {
    union { uint32_t u; float f; } v = {(uint32_t)bits << 16};  /* BF16 -> FP32 is exact */
    return v.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
enum { W = 16 };
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, x) _mm512_storeu_ps(p, x)
#define vbroadcast(x) _mm512_set1_ps(x)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmuladd(a, b, c) _mm512_add_ps(c, _mm512_mul_ps(a, b))
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
enum { W = 8 };
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, x) _mm256_storeu_ps(p, x)
#define vbroadcast(x) _mm256_set1_ps(x)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmuladd(a, b, c) _mm256_add_ps(c, _mm256_mul_ps(a, b))
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#else
typedef float vec;
enum { W = 1 };
#define vzero() 0.0f
#define vload(p) (*(p))
#define vstore(p, x) (*(p) = (x))
#define vbroadcast(x) (x)
#define vfma(a, b, c) fmaf(a, b, c)
#define vmuladd(a, b, c) ((c) + (a) * (b))
#define vadd(a, b) ((a) + (b))
#define vmax(a, b) ((a) > (b) ? (a) : (b))
#define vmul(a, b) ((a) * (b))
#endif

#endif
