/* Weight-only int8 products for a CPU: y = x . (q * scale)^T + bias, for the few rows of a decoding
 * step or a verification.
 *
 * x is float32 [M, K]; q is int8 [N, K] (one weight row per output, packed as below); scale and
 * bias are float32 [N]; y is float32 [M, N]. The weights are read once per call: a tile of 4 weight rows is
 * converted to float once for every group of activation rows (MB of them, held in registers: 6 with
 * AVX-512, enough for most verifications, 2 with AVX2) and
 * multiplied in float32, so the cost of a step stays near the cost of its weight bytes for up to
 * some 8 rows (a verification), and every weight byte is read from memory once however many rows.
 *
 * Batch invariance by construction: every output y[m, n] is computed by the same sequence of
 * operations whatever M is, wherever row m falls in a group, and however many threads share the
 * outputs: one vector accumulator, fused multiply-adds over k in ascending order, one fixed
 * horizontal sum, the scalar tail in ascending order, then the scale and the bias. The file must be
 * compiled without -ffast-math and with -ffp-contract=off (the scalar code is then never contracted
 * in one place and not in another).
 *
 * Built at first use by dynaspec.runtime.q8 with the compiler of the machine, for its own processor
 * (-march=native): AVX-512, AVX2 with FMA, or plain C.
 */
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#define MB 6
typedef __m512 vec;
static inline vec v_zero(void) { return _mm512_setzero_ps(); }
static inline vec v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vec v_weights(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vec v_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_sum(vec a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#define ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define MB 2
typedef __m256 vec;
static inline vec v_zero(void) { return _mm256_setzero_ps(); }
static inline vec v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vec v_weights(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vec v_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_sum(vec a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#define ISA "avx2"
#else
#define LANES 1
#define MB 2
typedef float vec;
static inline vec v_zero(void) { return 0.0f; }
static inline vec v_load(const float *p) { return *p; }
static inline vec v_weights(const int8_t *p) { return (float)*p; }
static inline vec v_fma(vec a, vec b, vec c) { return c + a * b; }
static inline float v_sum(vec a) { return a; }
#define ISA "scalar"
#endif

#define NB 4 /* weight rows per tile */

const char *q8_isa(void) { return ISA; }
int q8_lanes(void) { return LANES; }

/* The weights are packed by tiles (dynaspec.runtime.q8.pack): for each tile of NB weight rows (the
 * last one padded with zero rows), its vector part as [K / LANES][NB][LANES] int8, so that a tile is
 * read as one sequential stream (rows read side by side would be NB short streams, which hardware
 * prefetchers follow badly); then, apart, the tail columns K % LANES of every row, [N][K % LANES]. */

/* The vector part of the dot products of `mb` activation rows with the NB weight rows of one
 * packed tile: sums[i * NB + j] for row i of x and row j of the tile. Inlined with constant mb. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t K, int64_t kv,
                                                       const int8_t *restrict p, const int mb,
                                                       float *restrict sums) {
    vec acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = v_zero();
    for (int64_t k = 0; k < kv; k += LANES, p += NB * LANES) {
        vec w[NB];
        for (int j = 0; j < NB; j++) w[j] = v_weights(p + j * LANES);
        for (int i = 0; i < mb; i++) {
            vec xv = v_load(x + i * K + k);
            for (int j = 0; j < NB; j++) acc[i][j] = v_fma(xv, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NB; j++) sums[i * NB + j] = v_sum(acc[i][j]);
}

static void tile_any(const float *x, int64_t K, int64_t kv, const int8_t *p, int mb, float *sums) {
    switch (mb) {
        case 1: tile(x, K, kv, p, 1, sums); break;
        case 2: tile(x, K, kv, p, 2, sums); break;
#if MB >= 3
        case 3: tile(x, K, kv, p, 3, sums); break;
#endif
#if MB >= 4
        case 4: tile(x, K, kv, p, 4, sums); break;
#endif
#if MB >= 6
        case 5: tile(x, K, kv, p, 5, sums); break;
        case 6: tile(x, K, kv, p, 6, sums); break;
#endif
        default: break;
    }
}

static void rows_block(const float *x, int64_t M, int64_t K, const int8_t *packed, const int8_t *tail,
                       const float *scale, const float *bias, int64_t N, float *y, int64_t b) {
    const int64_t n0 = b * NB;
    const int nb = (int)(N - n0 < NB ? N - n0 : NB);
    const int64_t kv = K - K % LANES, kt = K - kv;
    const int8_t *p = packed + b * NB * kv;
    float sums[MB * NB];
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int mb = (int)(M - m0 < MB ? M - m0 : MB);
        tile_any(x + m0 * K, K, kv, p, mb, sums);
        for (int i = 0; i < mb; i++) {
            const float *xr = x + (m0 + i) * K + kv;
            for (int j = 0; j < nb; j++) {
                const int8_t *tr = tail + (n0 + j) * kt;
                float s = sums[i * NB + j];
                for (int64_t k = 0; k < kt; k++) s = s + xr[k] * (float)tr[k];
                s = s * scale[n0 + j];
                if (bias) s = s + bias[n0 + j];
                y[(m0 + i) * N + n0 + j] = s;
            }
        }
    }
}

int q8_tile_rows(void) { return NB; }

void q8_linear(const float *x, int64_t M, int64_t K, const int8_t *packed, const int8_t *tail,
               const float *scale, const float *bias, int64_t N, float *y, int threads) {
    const int64_t blocks = (N + NB - 1) / NB;
    if (threads <= 1) {
        for (int64_t b = 0; b < blocks; b++) rows_block(x, M, K, packed, tail, scale, bias, N, y, b);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) rows_block(x, M, K, packed, tail, scale, bias, N, y, b);
}


/* ---- RMS norm of rows, for the lean forward -----------------------------------------------------
 * y = x / sqrt(mean(x^2) + eps) * w, each row on its own, in float32; x and y are float32 or
 * bfloat16 (bf16 != 0), w float32. round_first != 0 (Llama's order): the normed row is rounded to
 * the dtype before the weight multiplies it, and the product is rounded again. One row's result
 * never depends on the other rows. */
static inline float to_dtype(float v, int bf16) {
    if (!bf16) return v;
    union { float f; uint32_t u; } c = {.f = v};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return v; /* NaN stays NaN */
    c.u = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) & 0xffff0000u; /* round to nearest even */
    return c.f;
}

static inline float load_any(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    union { uint32_t u; float f; } c = {.u = (uint32_t)((const uint16_t *)x)[i] << 16};
    return c.f;
}

static inline void store_any(void *y, int bf16, int64_t i, float v) {
    if (!bf16) { ((float *)y)[i] = v; return; }
    union { float f; uint32_t u; } c = {.f = to_dtype(v, 1)};
    ((uint16_t *)y)[i] = (uint16_t)(c.u >> 16);
}

#if defined(__AVX512F__)
/* 16 floats rounded to bfloat16 as to_dtype rounds one (to nearest even; NaN kept), as the upper
 * halves of float32 lanes */
static inline __m512i round16_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
                                       _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, u);
}

/* 16 bfloat16 values as float32 lanes; 16 float32 lanes rounded to bfloat16 (to nearest even, as
 * to_dtype rounds a finite value), as float32 lanes or stored as bfloat16 */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m256i bf16x16_bits(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);  /* one instruction where the processor has it */
#else
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round16_bf16(v), 16));
#endif
}
static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_bits(v)), 16));
}
static inline void bf16x16_store(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, bf16x16_bits(v)); }

/* rows of a width that is a multiple of 16: the squares summed in 16 lanes, then the lanes in a
 * fixed order; each row by the same operations whatever the row count */
static void rms_norm16(const void *x, int bf16, int64_t rows, int64_t d, const float *w, int round_first,
                       float eps, void *y) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < d; k += 16) {
            const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                        _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + base + k))), 16))
                                  : _mm512_loadu_ps((const float *)x + base + k);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps);
        const __m512 iv = _mm512_set1_ps(inv);
        for (int64_t k = 0; k < d; k += 16) {
            __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                  _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + base + k))), 16))
                            : _mm512_loadu_ps((const float *)x + base + k);
            v = _mm512_mul_ps(v, iv);
            if (round_first && bf16) v = _mm512_castsi512_ps(round16_bf16(v));
            if (w) v = _mm512_mul_ps(v, _mm512_loadu_ps(w + k));
            if (bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + base + k),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(round16_bf16(v), 16)));
            else
                _mm512_storeu_ps((float *)y + base + k, v);
        }
    }
}
#endif

void q8_rms_norm(const void *x, int bf16, int64_t rows, int64_t d, const float *w, int round_first, float eps,
                 void *y) {
#if defined(__AVX512F__)
    if (d % 16 == 0) { rms_norm16(x, bf16, rows, d, w, round_first, eps, y); return; }
#endif
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * d;
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t k = 0;
        for (; k + 8 <= d; k += 8)
            for (int l = 0; l < 8; l++) {
                float v = load_any(x, bf16, base + k + l);
                part[l] = part[l] + v * v;
            }
        float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        for (; k < d; k++) {
            float v = load_any(x, bf16, base + k);
            ss = ss + v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (k = 0; k < d; k++) {
            float v = load_any(x, bf16, base + k) * inv;
            if (round_first) v = to_dtype(v, bf16);
            store_any(y, bf16, base + k, v * (w ? w[k] : 1.0f));
        }
    }
}

/* h_out = h + delta (rounded to the dtype, as torch's addition rounds), then x = q8_rms_norm(h_out):
 * a residual connection and the next norm in one call, the same bits as the two apart */
void q8_add_rms_norm(const void *h, const void *delta, int bf16, int64_t rows, int64_t d, const float *w,
                     int round_first, float eps, void *h_out, void *x) {
    const int64_t n = rows * d;
    int64_t i0 = 0;
#if defined(__AVX512F__)
    if (bf16)
        for (; i0 + 16 <= n; i0 += 16)
            bf16x16_store((uint16_t *)h_out + i0, _mm512_add_ps(bf16x16_load((const uint16_t *)h + i0),
                                                                bf16x16_load((const uint16_t *)delta + i0)));
#endif
    for (int64_t i = i0; i < n; i++) store_any(h_out, bf16, i, load_any(h, bf16, i) + load_any(delta, bf16, i));
    q8_rms_norm(h_out, bf16, rows, d, w, round_first, eps, x);
}

/* ---- int16 activations: integer dot products ---------------------------------------------------------
 * Each activation row is quantised to int16 with one scale of its own (its largest magnitude over
 * 32767), the int8 weights are widened to int16 (one instruction per 32 or 16 weights), and the
 * products are summed in int32: AVX-512 VNNI's vpdpwssd (32 products an instruction), or AVX2's
 * vpmaddwd and vpaddd, with the weights converted once for every group of rows. Integer sums are exact, in
 * any order: the result of a row depends on that row alone. Lanes are flushed into int64 every 256
 * steps, before any lane could overflow (2 * 256 * 32767 * 127 < 2^31). The weights are packed as
 * above with ILANES per row and step, K padded with zeros to a multiple of ILANES (no tail). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ILANES 32
#define IMB 4
typedef __m512i ivec;
static inline ivec i_zero(void) { return _mm512_setzero_si512(); }
static inline ivec i_widen(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline ivec i_load(const int16_t *p) { return _mm512_loadu_si512((const void *)p); }
/* acc += the pairwise products of a and b, in place: GCC compiles the intrinsic with a copy of the
 * accumulator per instruction (and spills), the accumulator tied in asm does not */
#define DOT_I16(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
static inline int64_t i_sum(ivec a) {
    __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a));
    __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1));
    return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}
#define HAVE_I16 1
#elif defined(__AVX2__)
/* AVX2 without VNNI: vpmaddwd (pairs of int16 products summed into int32), then vpaddd */
#define ILANES 16
#define IMB 2
typedef __m256i ivec;
static inline ivec i_zero(void) { return _mm256_setzero_si256(); }
static inline ivec i_widen(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec i_load(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
#define DOT_I16(acc, a, b) ((acc) = _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b))))
static inline int64_t i_sum(ivec a) {
    __m256i v = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                 _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
    __m128i h = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
}
#define HAVE_I16 1
#endif

#ifdef HAVE_I16
#define FLUSH 256
int q8_int16_available(void) { return 1; }
int q8_int16_lanes(void) { return ILANES; }

static inline __attribute__((always_inline)) void tile_i16(const int16_t *restrict x, int64_t Kp,
                                                           const int8_t *restrict p, const int mb,
                                                           int64_t *restrict sums) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NB; j++) sums[i * NB + j] = 0;
    for (int64_t k0 = 0; k0 < Kp; k0 += FLUSH * ILANES) {
        const int64_t k1 = k0 + FLUSH * ILANES < Kp ? k0 + FLUSH * ILANES : Kp;
        ivec acc[IMB][NB];
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < NB; j++) acc[i][j] = i_zero();
        for (int64_t k = k0; k < k1; k += ILANES, p += NB * ILANES) {
            ivec w[NB];
            for (int j = 0; j < NB; j++) w[j] = i_widen(p + j * ILANES);
            for (int i = 0; i < mb; i++) {
                ivec xv = i_load(x + i * Kp + k);
                for (int j = 0; j < NB; j++) DOT_I16(acc[i][j], xv, w[j]);
            }
        }
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < NB; j++) sums[i * NB + j] += i_sum(acc[i][j]);
    }
}

static void tile_i16_any(const int16_t *x, int64_t Kp, const int8_t *p, int mb, int64_t *sums) {
    switch (mb) {
        case 1: tile_i16(x, Kp, p, 1, sums); break;
        case 2: tile_i16(x, Kp, p, 2, sums); break;
#if IMB >= 4
        case 3: tile_i16(x, Kp, p, 3, sums); break;
        case 4: tile_i16(x, Kp, p, 4, sums); break;
#endif
        default: break;
    }
}

static void rows_block_i16(const int16_t *xq, const float *sx, int64_t M, int64_t Kp, const int8_t *packed,
                           const float *scale, const float *bias, int64_t N, float *y, int64_t b) {
    const int64_t n0 = b * NB;
    const int nb = (int)(N - n0 < NB ? N - n0 : NB);
    const int8_t *p = packed + b * NB * Kp;
    int64_t sums[IMB * NB];
    for (int64_t m0 = 0; m0 < M; m0 += IMB) {
        const int mb = (int)(M - m0 < IMB ? M - m0 : IMB);
        tile_i16_any(xq + m0 * Kp, Kp, p, mb, sums);
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < nb; j++) {
                float s = (float)((double)sums[i * NB + j] * (double)sx[m0 + i] * (double)scale[n0 + j]);
                if (bias) s = s + bias[n0 + j];
                y[(m0 + i) * N + n0 + j] = s;
            }
    }
}

/* x: float32 (bf16 == 0) or bfloat16 [M, K]; packed weights [N, Kp] as described above. */
void q8_linear_i16(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                   const float *scale, const float *bias, int64_t N, float *y, int threads, int16_t *xq,
                   float *sx) {
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = fabsf(load_any(x, bf16, m * K + k));
            amax = v > amax ? v : amax;
        }
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        sx[m] = amax / 32767.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = nearbyintf(load_any(x, bf16, m * K + k) * inv);
            v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);
            xq[m * Kp + k] = (int16_t)v;
        }
        for (int64_t k = K; k < Kp; k++) xq[m * Kp + k] = 0;
    }
    const int64_t blocks = (N + NB - 1) / NB;
    if (threads <= 1) {
        for (int64_t b = 0; b < blocks; b++) rows_block_i16(xq, sx, M, Kp, packed, scale, bias, N, y, b);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) rows_block_i16(xq, sx, M, Kp, packed, scale, bias, N, y, b);
}
#else
int q8_int16_available(void) { return 0; }
int q8_int16_lanes(void) { return 0; }
void q8_linear_i16(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                   const float *scale, const float *bias, int64_t N, float *y, int threads, int16_t *xq,
                   float *sx) {
    (void)x; (void)bf16; (void)M; (void)K; (void)Kp; (void)packed; (void)scale; (void)bias; (void)N; (void)y;
    (void)threads; (void)xq; (void)sx;
}
#endif

/* ---- int8 activations: u8 x s8 dot products (AVX-512 VNNI's vpdpbusd) ----------------------------
 * Each activation row is quantised to int8 with one scale of its own (its largest magnitude over
 * 127, rounded to nearest even, within [-127, 127]) and stored offset by 128 as uint8, since
 * vpdpbusd multiplies unsigned by signed bytes: 64 products an instruction, four summed into each
 * int32 lane, with the weights used as they are stored (no widening). The offset is taken out
 * exactly afterwards: sum((xq + 128) * w) - 128 * sum(w), with sum(w) per weight row computed at
 * load time. Integer sums are exact in any order, so the result of a row depends on that row alone.
 * A lane gains at most 4 * 255 * 127 per step, and the 16 lanes of an accumulator are summed in
 * int32 (sum4_u8): accumulators are flushed into int64 every FLUSH8 steps (16 * 4 * 255 * 127 * 1024
 * < 2^31). Weights packed as above with 64 per row and step, K padded with
 * zeros to a multiple of 64. Up to U8MB activation rows share each tile of weights (24
 * accumulators, 4 weight vectors and one activation vector: 29 of the 32 registers). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define U8LANES 64
#define U8MB 6
#define FLUSH8 1024
#define DOT_U8(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))
int q8_u8_available(void) { return 1; }
int q8_u8_lanes(void) { return U8LANES; }

/* the four lane sums of a[0..3] as int32 [4]: pairs of vectors are interleaved and added (a
 * transposing reduction), 11 instructions for four sums instead of some 30 one by one */
static inline __m128i sum4_u8(const __m512i a[NB]) {
    __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    /* each 128-bit lane of u now holds partial sums of a[0], a[1], a[2], a[3] */
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* One chunk (weights of at most U8CHUNK columns): sums[i]: the dot products of activation row i
 * with the tile's NB weight rows, as int64 [NB]. tile_u8 and rows_block_u8 are kept apart from
 * their chunked forms below (tile_u8c, finish_u8) on purpose: built on those (a row stride and a
 * length for the activations, the epilogue's tile constants per row group), GCC's code for 7 to 12
 * rows of the gate-up shape ran 25-40% slower (scripts/q8_rows_bench.c, session 27). */
static inline __attribute__((always_inline)) void tile_u8(const uint8_t *restrict x, int64_t Kp,
                                                          const int8_t *restrict p, const int mb,
                                                          __m256i *restrict sums) {
    for (int i = 0; i < mb; i++) sums[i] = _mm256_setzero_si256();
    for (int64_t k0 = 0; k0 < Kp; k0 += (int64_t)FLUSH8 * U8LANES) {
        const int64_t k1 = k0 + (int64_t)FLUSH8 * U8LANES < Kp ? k0 + (int64_t)FLUSH8 * U8LANES : Kp;
        __m512i acc[U8MB][NB];
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += U8LANES, p += NB * U8LANES) {
            __m512i w[NB];
            for (int j = 0; j < NB; j++) w[j] = _mm512_loadu_si512((const void *)(p + j * U8LANES));
            for (int i = 0; i < mb; i++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x + i * Kp + k));
                for (int j = 0; j < NB; j++) DOT_U8(acc[i][j], xv, w[j]);
            }
        }
        for (int i = 0; i < mb; i++) sums[i] = _mm256_add_epi64(sums[i], _mm256_cvtepi32_epi64(sum4_u8(acc[i])));
    }
}

static void tile_u8_any(const uint8_t *x, int64_t Kp, const int8_t *p, int mb, __m256i *sums) {
    switch (mb) {
        case 1: tile_u8(x, Kp, p, 1, sums); break;
        case 2: tile_u8(x, Kp, p, 2, sums); break;
        case 3: tile_u8(x, Kp, p, 3, sums); break;
        case 4: tile_u8(x, Kp, p, 4, sums); break;
        case 5: tile_u8(x, Kp, p, 5, sums); break;
        case 6: tile_u8(x, Kp, p, 6, sums); break;
        default: break;
    }
}

/* y[m, n] = (float)(dot - 128 * wsum[n]) * sx[m] * scale[n] + bias[n] in float32 (the exact integer
 * rounded to float once, then the products and the sum left to right), four outputs at once (the
 * same IEEE operations, in the same order, as one at a time) */
static void rows_block_u8(const uint8_t *xq, const float *sx, int64_t M, int64_t Kp, const int8_t *packed,
                          const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y,
                          int64_t b) {
    const int64_t n0 = b * NB;
    const int nb = (int)(N - n0 < NB ? N - n0 : NB);
    const int8_t *p = packed + b * NB * Kp;
    const __mmask8 live = (__mmask8)((1u << nb) - 1u); /* the last tile may hold fewer than NB rows */
    const __m256i offset = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm_maskz_loadu_epi32(live, wsum + n0)), 7);
    const __m128 sw = _mm_maskz_loadu_ps(live, scale + n0);
    const __m128 bv = bias ? _mm_maskz_loadu_ps(live, bias + n0) : _mm_setzero_ps();
    __m256i sums[U8MB];
    for (int64_t m0 = 0; m0 < M; m0 += U8MB) {
        const int mb = (int)(M - m0 < U8MB ? M - m0 : U8MB);
        tile_u8_any(xq + m0 * Kp, Kp, p, mb, sums);
        for (int i = 0; i < mb; i++) {
            const __m128 dot = _mm256_cvtepi64_ps(_mm256_sub_epi64(sums[i], offset));
            __m128 v = _mm_mul_ps(_mm_mul_ps(dot, _mm_set1_ps(sx[m0 + i])), sw);
            if (bias) v = _mm_add_ps(v, bv);
            _mm_mask_storeu_ps(y + (m0 + i) * N + n0, live, v);
        }
    }
}

/* sums[i] += the dot products of activation row i (rows xs apart) over klen columns with the
 * tile's NB weight rows (p: the tile's packed weights from the first of those columns), as int64 [NB] */
static inline __attribute__((always_inline)) void tile_u8c(const uint8_t *restrict x, int64_t xs, int64_t klen,
                                                          const int8_t *restrict p, const int mb,
                                                          __m256i *restrict sums) {
    for (int64_t k0 = 0; k0 < klen; k0 += (int64_t)FLUSH8 * U8LANES) {
        const int64_t k1 = k0 + (int64_t)FLUSH8 * U8LANES < klen ? k0 + (int64_t)FLUSH8 * U8LANES : klen;
        __m512i acc[U8MB][NB];
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += U8LANES, p += NB * U8LANES) {
            __m512i w[NB];
            for (int j = 0; j < NB; j++) w[j] = _mm512_loadu_si512((const void *)(p + j * U8LANES));
            for (int i = 0; i < mb; i++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x + i * xs + k));
                for (int j = 0; j < NB; j++) DOT_U8(acc[i][j], xv, w[j]);
            }
        }
        for (int i = 0; i < mb; i++) sums[i] = _mm256_add_epi64(sums[i], _mm256_cvtepi32_epi64(sum4_u8(acc[i])));
    }
}

static void tile_u8c_any(const uint8_t *x, int64_t xs, int64_t klen, const int8_t *p, int mb, __m256i *sums) {
    switch (mb) {
        case 1: tile_u8c(x, xs, klen, p, 1, sums); break;
        case 2: tile_u8c(x, xs, klen, p, 2, sums); break;
        case 3: tile_u8c(x, xs, klen, p, 3, sums); break;
        case 4: tile_u8c(x, xs, klen, p, 4, sums); break;
        case 5: tile_u8c(x, xs, klen, p, 5, sums); break;
        case 6: tile_u8c(x, xs, klen, p, 6, sums); break;
        default: break;
    }
}

/* y[m, n] = (float)(dot - 128 * wsum[n]) * sx[m] * scale[n] + bias[n] (in float32) for
 * the mb rows from m0 and tile b, four outputs at once (the same IEEE operations, in the same order,
 * as one at a time) */
static void finish_u8(const __m256i *sums, const float *sx, int64_t m0, int mb, const int32_t *wsum,
                      const float *scale, const float *bias, int64_t N, float *y, int64_t b) {
    const int64_t n0 = b * NB;
    const int nb = (int)(N - n0 < NB ? N - n0 : NB);
    const __mmask8 live = (__mmask8)((1u << nb) - 1u); /* the last tile may hold fewer than NB rows */
    const __m256i offset = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm_maskz_loadu_epi32(live, wsum + n0)), 7);
    const __m128 sw = _mm_maskz_loadu_ps(live, scale + n0);
    const __m128 bv = bias ? _mm_maskz_loadu_ps(live, bias + n0) : _mm_setzero_ps();
    for (int i = 0; i < mb; i++) {
        const __m128 dot = _mm256_cvtepi64_ps(_mm256_sub_epi64(sums[i], offset));
        __m128 v = _mm_mul_ps(_mm_mul_ps(dot, _mm_set1_ps(sx[m0 + i])), sw);
        if (bias) v = _mm_add_ps(v, bv);
        _mm_mask_storeu_ps(y + (m0 + i) * N + n0, live, v);
    }
}

/* Weights wider than U8CHUNK columns are packed in column chunks: chunk c (columns c * U8CHUNK
 * on, klen of them) holds every tile's columns of that chunk, tile after tile, each as [klen / 64][NB][64]
 * (with one chunk, the layout above). A group of activation rows then streams the weights in one
 * sequential pass while only one chunk of its activations (at most 6 rows x 1024 bytes) is read
 * again and again, and stays in the L1 cache: with whole rows of a wide product (the down
 * product's 4864 columns x 6 rows, 29 KB) streamed weights evicted the activations, and 6 rows cost
 * 2.5 times one. Each tile's partial sums are kept across chunks for U8BATCH tiles at a time;
 * integer sums are exact in any order, so the result is the same bit for bit. */
#define U8CHUNK 1024
#ifndef U8BATCH
#define U8BATCH 32
#endif
int q8_u8_chunk(void) { return U8CHUNK; }

/* tiles b0..b1 of every activation row. Groups of U8MB rows share each pass over the weights; a
 * further group reads them again from the cache (a tile, or U8BATCH tiles of chunked weights, at a
 * time), not from memory. */
static void blocks_u8(const uint8_t *xq, const float *sx, int64_t M, int64_t Kp, const int8_t *packed,
                      const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y,
                      int64_t b0, int64_t b1, int ybf) {
    (void)ybf; /* float32 outputs only (q8_linear_u8 never asks for bfloat16) */
    const int64_t tiles = (N + NB - 1) / NB;
    if (Kp <= U8CHUNK) {  /* one chunk: tile after tile, every row group on each */
        for (int64_t b = b0; b < b1; b++) rows_block_u8(xq, sx, M, Kp, packed, wsum, scale, bias, N, y, b);
        return;
    }
    __m256i sums[U8BATCH * U8MB];
    /* fewer rows, more tiles a batch: the same partial sums, longer runs of the weights' stream */
    const int64_t batch = M < U8MB ? U8BATCH * U8MB / M : U8BATCH;
    for (int64_t t0 = b0; t0 < b1; t0 += batch) {
        const int64_t t1 = t0 + batch < b1 ? t0 + batch : b1;
        for (int64_t m0 = 0; m0 < M; m0 += U8MB) {
            const int mb = (int)(M - m0 < U8MB ? M - m0 : U8MB);
            const uint8_t *x = xq + m0 * Kp;
            for (int64_t i = 0; i < (t1 - t0) * mb; i++) sums[i] = _mm256_setzero_si256();
            for (int64_t k0 = 0; k0 < Kp; k0 += U8CHUNK) {
                const int64_t klen = Kp - k0 < U8CHUNK ? Kp - k0 : U8CHUNK;
                const int8_t *chunk = packed + k0 * NB * tiles;
                for (int64_t b = t0; b < t1; b++)
                    tile_u8c_any(x + k0, Kp, klen, chunk + b * NB * klen, mb, sums + (b - t0) * mb);
            }
            for (int64_t b = t0; b < t1; b++) finish_u8(sums + (b - t0) * mb, sx, m0, mb, wsum, scale, bias, N, y, b);
        }
    }
}

/* 16 values of row x from index k, as float32 (bf16 != 0: x holds bfloat16) */
static inline __m512 load16_any(const void *x, int bf16, int64_t k) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* one activation row quantised as described above: xq[0..Kp) (uint8, offset 128), its scale */
static void quantize_row_u8(const void *x, int bf16, int64_t K, int64_t Kp, uint8_t *xq, float *sx) {
    const int64_t kv = K - K % 16;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < kv; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16_any(x, bf16, k)));
    float amax = _mm512_reduce_max_ps(vmax);
    for (int64_t k = kv; k < K; k++) {
        float v = fabsf(load_any(x, bf16, k));
        amax = v > amax ? v : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *sx = amax / 127.0f;
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < kv; k += 16) {
        /* as the scalar code below: x * inv rounded to nearest even, clamped, offset */
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load16_any(x, bf16, k), vinv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i *)(xq + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), off)));
    }
    for (int64_t k = kv; k < K; k++) {
        float v = nearbyintf(load_any(x, bf16, k) * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        xq[k] = (uint8_t)((int)v + 128);
    }
    for (int64_t k = K; k < Kp; k++) xq[k] = 128; /* zero, offset (the weights there are 0) */
}

/* x: float32 (bf16 == 0) or bfloat16 [M, K]; packed weights [N, Kp] (64 per step), wsum [N] the sum
 * of each weight row's int8 values; xq [M, Kp] and sx [M] are scratch. */
/* the outputs of blocks b0..b1 (each `width` outputs) of every quantised activation row */
/* (ybf != 0: y is bfloat16 [M][N], each output rounded to nearest even as torch's conversion rounds) */
typedef void (*blocks_u8_fn)(const uint8_t *xq, const float *sx, int64_t M, int64_t Kp, const int8_t *packed,
                             const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y,
                             int64_t b0, int64_t b1, int ybf);

/* quantise the activation rows, then the blocks of outputs, split evenly across the threads */
static void linear_u8_by(blocks_u8_fn blocks_of, int64_t width, const void *x, int bf16, int64_t M, int64_t K,
                         int64_t Kp, const int8_t *packed, const int32_t *wsum, const float *scale,
                         const float *bias, int64_t N, float *y, int threads, uint8_t *xq, float *sx, int ybf) {
    for (int64_t m = 0; m < M; m++)
        quantize_row_u8((const char *)x + (size_t)(m * K) * (bf16 ? 2 : 4), bf16, K, Kp, xq + m * Kp, sx + m);
    const int64_t blocks = (N + width - 1) / width;
    if (threads <= 1) {
        blocks_of(xq, sx, M, Kp, packed, wsum, scale, bias, N, y, 0, blocks, ybf);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; t++)
        blocks_of(xq, sx, M, Kp, packed, wsum, scale, bias, N, y, blocks * t / threads, blocks * (t + 1) / threads,
                  ybf);
}

void q8_linear_u8(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                  const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y, int threads,
                  uint8_t *xq, float *sx) {
    linear_u8_by(blocks_u8, NB, x, bf16, M, K, Kp, packed, wsum, scale, bias, N, y, threads, xq, sx, 0);
}

/* ---- int8 activations on AMX tiles (Intel's TMUL: tdpbusd) -----------------------------------------
 * The same products as q8_linear_u8, and the same results bit for bit: the same quantised rows, the
 * same u8 x s8 products summed exactly in int32 (any order gives the same integer; a tile's int32
 * sums cannot overflow while Kp * 255 * 127 < 2^31, which q8_amx_max_k bounds), then the same
 * epilogue. One tdpbusd multiplies up to 16 activation rows by a 64 x 16 tile of weights, so up to
 * 16 rows cost about what one costs: the weights' bytes. The weights are packed for it in blocks of
 * 64 outputs: block b, step s (64 columns) holds four 1 KB tiles, one per 16 outputs, each
 * [16 column quads][16 outputs][4 columns] (the layout tdpbusd's second operand reads), so a block
 * streams its weights in one sequential pass. N is padded to a multiple of 64 with zero rows. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512DQ__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define Q8_AMX 1
#define AMX_BLOCK 64
#define AMX_ROWS 16

/* the process's permission to use the tile registers (Linux asks for it once per process) */
int q8_amx_available(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}
int64_t q8_amx_max_k(void) { return (int64_t)2147483647 / (255 * 127); }
int q8_amx_rows(void) { return AMX_ROWS; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

/* tiles 0-3: the sums of 16 outputs each (mb rows of 16 int32); 4: mb activation rows of 64 bytes;
 * 5-7: weight tiles (16 quads of 16 outputs) */
static void amx_configure(int mb) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) { cfg.rows[t] = (uint8_t)mb; cfg.colsb[t] = 64; }
    for (int t = 5; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* 16 float32 outputs as bfloat16, rounded to nearest even (torch's conversion; NaN: 0x7fc0) */
static inline void store16_bf16(uint16_t *dst, __mmask16 live, __m512 v) {
    __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
    r = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm256_set1_epi16(0x7fc0));
    _mm256_mask_storeu_epi16(dst, live, r);
}

/* y rows m0..m0+mb of outputs n0..n0+width (those below N) from the int32 sums s [mb][width], as
 * rows_block_u8 computes them: (float)(dot - 128 * wsum) * sx * scale + bias in float32, 16 outputs at
 * once (ybf: stored as bfloat16, rounded to nearest even as torch converts) */
static void amx_finish(const int32_t *s, const float *sx, int64_t m0, int mb, const int32_t *wsum,
                       const float *scale, const float *bias, int64_t N, float *y, int64_t n0, int width,
                       int ybf) {
    for (int64_t j = 0; j < width; j += 16) {
        const int64_t n = n0 + j;
        if (n >= N) break;
        const __mmask16 live = (__mmask16)(N - n >= 16 ? 0xffff : (1u << (N - n)) - 1u);
        const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(live, wsum + n), 7);
        const __m512 sw = _mm512_maskz_loadu_ps(live, scale + n);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(live, bias + n) : _mm512_setzero_ps();
        for (int i = 0; i < mb; i++) {
            const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512((const void *)(s + i * width + j)), offset));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(sx[m0 + i])), sw);
            if (bias) v = _mm512_add_ps(v, bv);
            if (ybf) store16_bf16((uint16_t *)y + (m0 + i) * N + n, live, v);
            else _mm512_mask_storeu_ps(y + (m0 + i) * N + n, live, v);
        }
    }
}

/* Tiles are always configured for 16 activation rows; the last group of a call may hold fewer, and
 * reads the rows after them from the scratch buffer, which the caller sizes to a whole number of
 * groups (their sums are not stored). Each block of weights is read from memory once, for every
 * group of rows: the other groups find it in the cache. Past 16 rows, groups go in pairs over half
 * a block (32 outputs) at a time: each weight tile loaded serves both groups (tiles 0-3: the sums,
 * 4-5: the two groups' rows, 6-7: the weights), which halves the weights' traffic from the cache,
 * the bound of a product over many rows (a prefill). The int32 sums are exact in any order, so
 * every path gives the same outputs. */
/* whether groups of rows go in pairs (1, the default) or one by one (0: for side-by-side timing) */
static int amx_pairs = 1;
void q8_set_amx_pairs(int on) { amx_pairs = on; }

static void blocks_amx(const uint8_t *xq, const float *sx, int64_t M, int64_t Kp, const int8_t *packed,
                       const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y,
                       int64_t b0, int64_t b1, int ybf) {
    int32_t sums[AMX_ROWS * AMX_BLOCK];
    const int64_t steps = Kp / 64;
    amx_configure(AMX_ROWS);
    for (int64_t b = b0; b < b1; b++) {
        int64_t m0 = 0;
        for (; amx_pairs && m0 + AMX_ROWS < M; m0 += 2 * AMX_ROWS) {  /* two groups, the second maybe partial */
            const int mb = (int)(M - m0 - AMX_ROWS < AMX_ROWS ? M - m0 - AMX_ROWS : AMX_ROWS);
            const uint8_t *x0 = xq + m0 * Kp, *x1 = xq + (m0 + AMX_ROWS) * Kp;
            for (int h = 0; h < 2; h++) {
                const int8_t *p = packed + b * AMX_BLOCK * Kp + h * 2048;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t s = 0; s < steps; s++, p += 4 * 1024) {
                    _tile_loadd(4, x0 + s * 64, Kp);
                    _tile_loadd(6, p, 64);
                    _tile_dpbusd(0, 4, 6);
                    _tile_loadd(7, p + 1024, 64);
                    _tile_dpbusd(1, 4, 7);
                    _tile_loadd(5, x1 + s * 64, Kp);
                    _tile_dpbusd(2, 5, 6);
                    _tile_dpbusd(3, 5, 7);
                }
                _tile_stored(0, sums, 32 * 4);
                _tile_stored(1, sums + 16, 32 * 4);
                _tile_stored(2, sums + AMX_ROWS * 32, 32 * 4);
                _tile_stored(3, sums + AMX_ROWS * 32 + 16, 32 * 4);
                amx_finish(sums, sx, m0, AMX_ROWS, wsum, scale, bias, N, y, b * AMX_BLOCK + h * 32, 32, ybf);
                amx_finish(sums + AMX_ROWS * 32, sx, m0 + AMX_ROWS, mb, wsum, scale, bias, N, y,
                           b * AMX_BLOCK + h * 32, 32, ybf);
            }
        }
        for (; m0 < M; m0 += AMX_ROWS) {  /* a last group alone (every group, at 16 rows or fewer) */
            const int mb = (int)(M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS);
            const uint8_t *x = xq + m0 * Kp;
            const int8_t *p = packed + b * AMX_BLOCK * Kp;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t s = 0; s < steps; s++, p += 4 * 1024) {
                _tile_loadd(4, x + s * 64, Kp);
                _tile_loadd(5, p, 64);
                _tile_dpbusd(0, 4, 5);
                _tile_loadd(6, p + 1024, 64);
                _tile_dpbusd(1, 4, 6);
                _tile_loadd(7, p + 2048, 64);
                _tile_dpbusd(2, 4, 7);
                _tile_loadd(5, p + 3072, 64);
                _tile_dpbusd(3, 4, 5);
            }
            _tile_stored(0, sums, AMX_BLOCK * 4);
            _tile_stored(1, sums + 16, AMX_BLOCK * 4);
            _tile_stored(2, sums + 32, AMX_BLOCK * 4);
            _tile_stored(3, sums + 48, AMX_BLOCK * 4);
            amx_finish(sums, sx, m0, mb, wsum, scale, bias, N, y, b * AMX_BLOCK, AMX_BLOCK, ybf);
        }
    }
    _tile_release();
}

/* as q8_linear_u8, with the weights packed for AMX (above); xq holds a whole number of 16-row groups */
void q8_linear_amx(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                   const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y, int threads,
                   uint8_t *xq, float *sx) {
    linear_u8_by(blocks_amx, AMX_BLOCK, x, bf16, M, K, Kp, packed, wsum, scale, bias, N, y, threads, xq, sx, 0);
}

/* as q8_linear_amx, writing y as bfloat16 [M][N]: the float32 outputs rounded as torch's conversion
 * rounds them, without a float32 copy of the outputs and a second pass over it */
void q8_linear_amx_bf16(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                        const int32_t *wsum, const float *scale, const float *bias, int64_t N, uint16_t *y,
                        int threads, uint8_t *xq, float *sx) {
    linear_u8_by(blocks_amx, AMX_BLOCK, x, bf16, M, K, Kp, packed, wsum, scale, bias, N, (float *)y, threads, xq,
                 sx, 1);
}
#endif
#else
int q8_u8_available(void) { return 0; }
int q8_u8_lanes(void) { return 0; }
int q8_u8_chunk(void) { return 0; }
void q8_linear_u8(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                  const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y, int threads,
                  uint8_t *xq, float *sx) {
    (void)x; (void)bf16; (void)M; (void)K; (void)Kp; (void)packed; (void)wsum; (void)scale; (void)bias; (void)N;
    (void)y; (void)threads; (void)xq; (void)sx;
}
#endif

/* without AMX (or without the VNNI code it shares): none of it */
#ifndef Q8_AMX
int q8_amx_available(void) { return 0; }
void q8_set_amx_pairs(int on) { (void)on; }
int64_t q8_amx_max_k(void) { return 0; }
int q8_amx_rows(void) { return 1; }
void q8_linear_amx(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                   const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y, int threads,
                   uint8_t *xq, float *sx) {
    (void)x; (void)bf16; (void)M; (void)K; (void)Kp; (void)packed; (void)wsum; (void)scale; (void)bias; (void)N;
    (void)y; (void)threads; (void)xq; (void)sx;
}
void q8_linear_amx_bf16(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                        const int32_t *wsum, const float *scale, const float *bias, int64_t N, uint16_t *y,
                        int threads, uint8_t *xq, float *sx) {
    (void)x; (void)bf16; (void)M; (void)K; (void)Kp; (void)packed; (void)wsum; (void)scale; (void)bias; (void)N;
    (void)y; (void)threads; (void)xq; (void)sx;
}
#endif

/* ---- quantising and packing, at load time ----------------------------------------------------------
 * Each row of w (float32, or bfloat16 with bf16 != 0) [N, K] as int8 times a scale: scale = largest
 * magnitude / 127 (1 for a row of zeros), q = w / scale rounded to nearest even, within [-127, 127];
 * written straight into the kernel's layout: tiles of NB rows (the last padded with zero rows), the
 * first kv = Kp - Kp % lanes columns as [kv / lanes][NB][lanes], the rest of each row into tail
 * [N][Kp - kv]; columns K..Kp (zero padding) are zeros. One pass over the weights. */
void q8_quantize_rowmajor(const void *w, int bf16, int64_t N, int64_t K, int8_t *q, float *scale);

void q8_quantize_pack(const void *w, int bf16, int64_t N, int64_t K, int64_t Kp, int lanes, int8_t *packed,
                      int8_t *tail, float *scale) {
    const int64_t kv = Kp - Kp % lanes, kt = Kp - kv, tiles = (N + NB - 1) / NB;
    int8_t *row = (int8_t *)calloc((size_t)Kp, 1); /* one row quantised, then copied into place */
    if (!row) return;
    for (int64_t t = 0; t < tiles; t++)
        for (int j = 0; j < NB; j++) {
            const int64_t n = t * NB + j;
            if (n < N) {
                const size_t bytes = bf16 ? 2 : 4;
                q8_quantize_rowmajor((const char *)w + (size_t)(n * K) * bytes, bf16, 1, K, row, scale + n);
            } else {
                memset(row, 0, (size_t)K);
            }
            int8_t *dst = packed + t * NB * kv + (int64_t)j * lanes;
            for (int64_t k = 0; k < kv; k += lanes) memcpy(dst + k * NB, row + k, (size_t)lanes);
            if (n < N && kt) memcpy(tail + n * kt, row + kv, (size_t)kt);
        }
    free(row);
}

/* ---- chosen rows of a row-major int8 matrix, for the draft head ------------------------------------
 * y[m, r] = scale[ids[r]] * (x[m] . q[ids[r]]) for float32 x [M, K] and int8 q [V, K] stored row by
 * row (a shortlist of LM-head rows, read in place: no gather copy). Drafting needs no batch
 * invariance, but the sums are still in a fixed order. */
void q8_rows(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, const int64_t *ids,
             int64_t R, float *y, int threads) {
    const int64_t kv = K - K % LANES;
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1) if (threads > 1)
    for (int64_t r = 0; r < R; r++) {
        const int8_t *row = q + ids[r] * K;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int mb = (int)(M - m0 < MB ? M - m0 : MB);
            vec acc[MB];
            for (int i = 0; i < mb; i++) acc[i] = v_zero();
            for (int64_t k = 0; k < kv; k += LANES) {
                const vec w = v_weights(row + k);
                for (int i = 0; i < mb; i++) acc[i] = v_fma(v_load(x + (m0 + i) * K + k), w, acc[i]);
            }
            for (int i = 0; i < mb; i++) {
                float s = v_sum(acc[i]);
                for (int64_t k = kv; k < K; k++) s = s + x[(m0 + i) * K + k] * (float)row[k];
                y[(m0 + i) * R + r] = s * scale[ids[r]];
            }
        }
    }
}

/* ---- the same with 8-bit activations, on AVX-512 VNNI ----------------------------------------------
 * y[m, r] = ((float)(xq[m] . q[ids[r]]) * sx[m]) * scale[ids[r]], where each activation row is
 * quantised as a weight row is (q8_quantize_rowmajor: sx = largest magnitude / 127, xq = x / sx
 * rounded to even) and the integer sum is exact. vpdpbusd multiplies unsigned bytes by signed
 * ones: the weights are flipped to unsigned (w + 128, one xor) and multiplied by the signed
 * activations, so sum (w + 128) xq = sum w xq + 128 sum xq, and 128 sum xq[m] is taken off once.
 * Four weight rows at a time (four independent sums in flight, the rows PF ahead prefetched), so
 * a cold shortlist streams from memory instead of waiting on one row's loads and one sum's chain:
 * one instruction per 64 products against four (convert, multiply-add) per 16 in q8_rows.
 * xq is scratch of M * ceil(K / 64) * 64 bytes, sx of M floats. Drafting only: the draft logits
 * round otherwise than the float32 rows do; verification keeps the output exact. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RB 4  /* weight rows at a time */
#define PF 16 /* how many rows ahead the prefetches run */
#define DOT_U8(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
int q8_rows_u8_available(void) { return 1; }

static inline int32_t hsum_epi32(__m512i a) { return _mm512_reduce_add_epi32(a); }

void q8_rows_u8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, const int64_t *ids,
                int64_t R, float *y, int8_t *xq, float *sx, int threads) {
    const int64_t Kp = (K + 63) / 64 * 64, steps = Kp / 64;
    const __mmask64 tail = (K % 64) ? (((__mmask64)1 << (K % 64)) - 1) : ~(__mmask64)0;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int32_t xsum[64];
    int64_t m0 = 0;
    for (int64_t m = 0; m < M; m++) {
        memset(xq + m * Kp, 0, (size_t)Kp);
        q8_quantize_rowmajor(x + m * K, 0, 1, K, xq + m * Kp, sx + m);
    }
    for (; m0 < M; m0 += 64) {  /* activation rows in groups of up to 64 (their corrections on the stack) */
        const int64_t mb = M - m0 < 64 ? M - m0 : 64;
        for (int64_t m = 0; m < mb; m++) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; k++) s += xq[(m0 + m) * Kp + k];
            xsum[m] = 128 * s;
        }
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1) if (threads > 1)
        for (int64_t r0 = 0; r0 < R; r0 += RB) {
            const int rb = (int)(R - r0 < RB ? R - r0 : RB);
            const int8_t *row[RB];
            for (int j = 0; j < RB; j++) row[j] = q + ids[r0 + (j < rb ? j : 0)] * K;
            for (int64_t j = r0 + PF; j < r0 + PF + RB && j < R; j++)
                for (int64_t k = 0; k < K; k += 64) _mm_prefetch((const char *)(q + ids[j] * K + k), _MM_HINT_T0);
            for (int64_t m = 0; m < mb; m++) {
                const int8_t *a = xq + (m0 + m) * Kp;
                __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
                for (int64_t s = 0; s < steps; s++) {
                    const __mmask64 mask = s == steps - 1 ? tail : ~(__mmask64)0;
                    const __m512i xs = _mm512_loadu_si512((const void *)(a + s * 64));
                    const __m512i w0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row[0] + s * 64), flip);
                    const __m512i w1 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row[1] + s * 64), flip);
                    const __m512i w2 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row[2] + s * 64), flip);
                    const __m512i w3 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row[3] + s * 64), flip);
                    DOT_U8(acc0, w0, xs);
                    DOT_U8(acc1, w1, xs);
                    DOT_U8(acc2, w2, xs);
                    DOT_U8(acc3, w3, xs);
                }
                const int32_t sums[RB] = {hsum_epi32(acc0), hsum_epi32(acc1), hsum_epi32(acc2), hsum_epi32(acc3)};
                for (int j = 0; j < rb; j++)
                    y[(m0 + m) * R + r0 + j] = ((float)(sums[j] - xsum[m]) * sx[m0 + m]) * scale[ids[r0 + j]];
            }
        }
    }
}
#else
int q8_rows_u8_available(void) { return 0; }
void q8_rows_u8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, const int64_t *ids,
                int64_t R, float *y, int8_t *xq, float *sx, int threads) {
    (void)threads; (void)x; (void)M; (void)K; (void)q; (void)scale; (void)ids; (void)R; (void)y; (void)xq; (void)sx;
}
#endif

/* q [N, K] row-major int8 and scale [N] of w (float32, or bfloat16 with bf16 != 0), as in
 * q8_quantize_pack: scale = largest magnitude / 127 (1 for zeros), q = w / scale rounded to even. */
void q8_quantize_rowmajor(const void *w, int bf16, int64_t N, int64_t K, int8_t *q, float *scale) {
    for (int64_t n = 0; n < N; n++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = fabsf(load_any(w, bf16, n * K + k));
            amax = v > amax ? v : amax;
        }
        const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        scale[n] = s;
        for (int64_t k = 0; k < K; k++) {
            float v = nearbyintf(load_any(w, bf16, n * K + k) / s);
            q[n * K + k] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
    }
}

/* ---- attention of a few rows over a cache, for the lean forward ----------------------------------
 * For each row r and query head h (kv head g = h / (H / Hkv)), over the keys j in [start[r], end[r]):
 *   s_j = (q[r, h] . k[g, j]) * scale,  p_j = exp(s_j - max s),  out[r, h] = sum_j p_j v[g, j] / sum_j p_j
 * in float32 from float32 or bfloat16 inputs (bf16 != 0: q, the cache and out are bfloat16), the
 * result rounded to the dtype once. q is [T, H, D] with rows q_row apart (in elements); the cache's
 * keys and values are [Hkv, L, D] with kv heads kv_head apart and positions kv_pos apart (the
 * lean forward's KV buffers, read in place); out is [T, H * D], contiguous.
 *
 * Batch invariance by construction: a row's result depends on its own query and its own key range
 * only, computed by the same sequence of operations whatever T is and wherever the row falls in
 * it. So a chain's rows attended together equal the plain steps that attend them one at a time;
 * one call replaces a torch attention call per row and layer (some 30-90 us each on one core).
 * The exponential is computed in the same way for every key (a vector polynomial with AVX-512,
 * libm's expf otherwise), and every sum runs in an order fixed by the key range alone.
 *
 * Draft trees: key positions are virtual. With map != NULL, row r's virtual position p >= base
 * reads the cache entry map[off[r] + p - base] (its ancestors' slots, root first, then itself):
 * the entries a plain step at virtual position end[r] - 1 will read at base, base + 1, ... once
 * the accepted line is moved there. Same values in the same order through the same operations:
 * a tree row equals that plain step bit for bit. */
#define KV_AT(p) ((map && (p) >= base) ? map[(p) - base] : (p))
#if defined(__AVX512F__)
int q8_attend_vector(void) { return 1; }

static inline __m512 load16_kv(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp(x) for x <= 0 (x below -87 gives exp(-87)): 2^n * poly(r), r = x - n ln 2, |r| <= 0.35, a
 * degree-6 polynomial (relative error about 1e-7) */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* the largest of a row of scores (nv of them in whole vectors, then the tail's lanes), in every lane */
static inline __m512 row_max(const float *si, int64_t nv, __mmask16 tail) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < nv; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(si + j));
    if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, si + nv));
    return _mm512_set1_ps(_mm512_reduce_max_ps(mv));
}

/* the sums of a[0..15] as one vector (lane j: the sum of a[j]'s 16 lanes), by a transposing
 * reduction: 45 instructions for 16 sums, each summed by the same tree of additions */
static inline __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int p = 0; p < 8; p++)
        b[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    for (int p = 0; p < 4; p++) {
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * p]), _mm512_castps_pd(b[2 * p + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * p]), _mm512_castps_pd(b[2 * p + 1]));
        c[p] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* c[p]: four 128-bit chunks, each the partial sums of a[4p..4p+3] */
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

/* one kv head's G query heads of one row, D = 16 * NC; kf: scratch for 16 keys as float32 */
static inline __attribute__((always_inline)) void attend_group_vec(
        const void *q, int bf16, int64_t G, const void *k, const void *v, int64_t kv_pos, int64_t start,
        int64_t end, const int64_t *map, int64_t base, float scale, void *out, float *qf, float *s, float *kf,
        const int NC) {
    const int64_t D = 16 * NC, n = end - start;
    const size_t es = bf16 ? 2 : 4;
    for (int64_t i = 0; i < G; i++)
        for (int c = 0; c < NC; c++)
            _mm512_storeu_ps(qf + i * D + 16 * c, load16_kv((const char *)q + (size_t)(i * D + 16 * c) * es, bf16));
    /* scores, 16 keys at a time: the keys converted once, then each head's 16 dot products */
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int cnt = (int)(n - j0 < 16 ? n - j0 : 16);
#if defined(__AVX512BF16__)
        if (bf16) {
            /* bfloat16 queries and keys: pairs of products summed into float32 lanes (vdpbf16ps,
             * products exact, denormals flushed), read in place: half the instructions of float32
             * FMAs on converted keys. The same operations for every row and key. */
            const char *kj[16];
            for (int jj = 0; jj < cnt; jj++) kj[jj] = (const char *)k + (size_t)(KV_AT(start + j0 + jj) * kv_pos) * 2;
            const __mmask16 live = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
            for (int64_t i = 0; i < G; i++) {
                const char *qi = (const char *)q + (size_t)(i * D) * 2;
                __m512bh qv[8];
                for (int c = 0; c < NC / 2; c++) qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qi + 64 * c));
                __m512 a[16];
                for (int jj = 0; jj < 16; jj++) {
                    if (jj >= cnt) { a[jj] = _mm512_setzero_ps(); continue; }
                    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                                  (__m512bh)_mm512_loadu_si512((const void *)kj[jj]));
                    for (int c = 1; c < NC / 2; c++)
                        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512((const void *)(kj[jj] + 64 * c)));
                    a[jj] = acc;
                }
                _mm512_mask_storeu_ps(s + i * n + j0, live, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
            }
            continue;
        }
#endif
        for (int jj = 0; jj < cnt; jj++) {
            const char *kj = (const char *)k + (size_t)(KV_AT(start + j0 + jj) * kv_pos) * es;
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(kf + jj * D + 16 * c, load16_kv(kj + (size_t)(16 * c) * es, bf16));
        }
        const __mmask16 live = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
        for (int64_t i = 0; i < G; i++) {
            __m512 a[16];
            for (int jj = 0; jj < 16; jj++) {
                if (jj >= cnt) { a[jj] = _mm512_setzero_ps(); continue; }
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + i * D), _mm512_loadu_ps(kf + jj * D));
                for (int c = 1; c < NC; c++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i * D + 16 * c), _mm512_loadu_ps(kf + jj * D + 16 * c), acc);
                a[jj] = acc;
            }
            _mm512_mask_storeu_ps(s + i * n + j0, live, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
        }
    }
    float total[16];
    for (int64_t i = 0; i < G; i++) {
        float *si = s + i * n;
        const int64_t nv = n - n % 16;
        const __mmask16 tail = (__mmask16)((1u << (n - nv)) - 1u);
        const __m512 m = row_max(si, nv, tail);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < nv; j += 16) {
            const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(si + j), m));
            _mm512_storeu_ps(si + j, p);
            sum = _mm512_add_ps(sum, p);
        }
        if (tail) {
            const __m512 p = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, si + nv), m)));
            _mm512_mask_storeu_ps(si + nv, tail, p);
            sum = _mm512_add_ps(sum, p);
        }
        total[i] = _mm512_reduce_add_ps(sum);
    }
    /* values: each value row converted once per group of heads (16 accumulators a group) */
    /* as many heads a group as 28 accumulators hold (with the value row's NC vectors, 32 registers;
     * the weights are broadcast from memory): a value row is converted once per group. Every
     * accumulator sums over the keys in the same order whatever the grouping. */
    const int HG = 28 / NC;
    for (int64_t i0 = 0; i0 < G; i0 += HG) {
        const int hg = (int)(G - i0 < HG ? G - i0 : HG);
        __m512 acc[28];
        for (int x = 0; x < 28; x++) acc[x] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const char *vj = (const char *)v + (size_t)(KV_AT(start + j) * kv_pos) * es;
            __m512 vc[16];
            for (int c = 0; c < NC; c++) vc[c] = load16_kv(vj + (size_t)(16 * c) * es, bf16);
            for (int h = 0; h < hg; h++) {
                const __m512 p = _mm512_set1_ps(s[(i0 + h) * n + j]);
                for (int c = 0; c < NC; c++) acc[h * NC + c] = _mm512_fmadd_ps(p, vc[c], acc[h * NC + c]);
            }
        }
        for (int h = 0; h < hg; h++) {
            const __m512 t = _mm512_set1_ps(total[i0 + h]);
            for (int c = 0; c < NC; c++) {
                float o[16];
                _mm512_storeu_ps(o, _mm512_div_ps(acc[h * NC + c], t));
                for (int l = 0; l < 16; l++) store_any(out, bf16, (i0 + h) * D + 16 * c + l, o[l]);
            }
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same attention with AVX2's 8 lanes (no AVX-512): the same steps as attend_group_vec, each
 * in an order fixed by the row's key range alone (8 keys a block, a fixed tree of additions per
 * sum), so the same batch invariance by construction. */
int q8_attend_vector(void) { return 1; }

static inline __m256 load8_kv(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* exp(x) for x <= 0, as exp_nonpositive: the same reduction and polynomial, 2^n (n >= -126 once x
 * >= -87) put into the exponent's bits */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* lanes [0, cnt) set: the mask of a block's first cnt keys */
static inline __m256i live8(int cnt) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the sums of a[0..7] as one vector (lane j: the sum of a[j]'s 8 lanes), by pairwise additions:
 * the same tree for every lane */
static inline __m256 sum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: a[0..3]'s sums of lanes 0-3, then of lanes 4-7; u1 the same for a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* one kv head's G query heads of one row, D = 8 * NC; kf: scratch for 8 keys as float32 */
static void attend_group_avx2(const void *q, int bf16, int64_t G, const void *k, const void *v, int64_t kv_pos,
                              int64_t start, int64_t end, const int64_t *map, int64_t base, float scale, void *out,
                              float *qf, float *s, float *kf, const int NC) {
    const int64_t D = 8 * NC, n = end - start;
    const size_t es = bf16 ? 2 : 4;
    for (int64_t i = 0; i < G; i++)
        for (int c = 0; c < NC; c++)
            _mm256_storeu_ps(qf + i * D + 8 * c, load8_kv((const char *)q + (size_t)(i * D + 8 * c) * es, bf16));
    /* scores, 8 keys at a time: float32 keys read in place, bfloat16 ones converted once */
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int cnt = (int)(n - j0 < 8 ? n - j0 : 8);
        const float *kp[8];
        for (int jj = 0; jj < cnt; jj++) {
            const char *kj = (const char *)k + (size_t)(KV_AT(start + j0 + jj) * kv_pos) * es;
            if (bf16) {
                for (int c = 0; c < NC; c++) _mm256_storeu_ps(kf + jj * D + 8 * c, load8_kv(kj + (size_t)(8 * c) * 2, 1));
                kp[jj] = kf + jj * D;
            } else {
                kp[jj] = (const float *)kj;
            }
        }
        const __m256i live = live8(cnt);
        for (int64_t i = 0; i < G; i++) {
            const float *qi = qf + i * D;
            __m256 a[8];
            for (int jj = 0; jj < 8; jj++) {
                if (jj >= cnt) { a[jj] = _mm256_setzero_ps(); continue; }
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qi), _mm256_loadu_ps(kp[jj]));
                for (int c = 1; c < NC; c++)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8 * c), _mm256_loadu_ps(kp[jj] + 8 * c), acc);
                a[jj] = acc;
            }
            _mm256_maskstore_ps(s + i * n + j0, live, _mm256_mul_ps(sum8(a), _mm256_set1_ps(scale)));
        }
    }
    float total[16];
    const int64_t nv = n - n % 8;
    const __m256i tail = live8((int)(n - nv));
    for (int64_t i = 0; i < G; i++) {
        float *si = s + i * n;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < nv; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(si + j));
        float m = -INFINITY;
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        for (int64_t j = nv; j < n; j++) m = si[j] > m ? si[j] : m;
        const __m256 mb = _mm256_set1_ps(m);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < nv; j += 8) {
            const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(si + j), mb));
            _mm256_storeu_ps(si + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        if (n > nv) {
            const __m256 p = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(si + nv, tail), mb)),
                                           _mm256_castsi256_ps(tail));
            _mm256_maskstore_ps(si + nv, tail, p);
            sum = _mm256_add_ps(sum, p);
        }
        total[i] = v_sum(sum); /* the products' lane sum above: a fixed tree of additions */
    }
    /* values: for each 8 of the D outputs, every head's weighted sum over the keys in order (one
     * accumulator per head; a value vector is converted once for all G heads) */
    for (int c = 0; c < NC; c++) {
        __m256 acc[16];
        for (int64_t h = 0; h < G; h++) acc[h] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m256 vc = load8_kv((const char *)v + (size_t)(KV_AT(start + j) * kv_pos + 8 * c) * es, bf16);
            for (int64_t h = 0; h < G; h++) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(s[h * n + j]), vc, acc[h]);
        }
        for (int64_t h = 0; h < G; h++) {
            float o[8];
            _mm256_storeu_ps(o, _mm256_div_ps(acc[h], _mm256_set1_ps(total[h])));
            for (int l = 0; l < 8; l++) store_any(out, bf16, h * D + 8 * c + l, o[l]);
        }
    }
}
#else
int q8_attend_vector(void) { return 0; }
#endif

/* ---- the same attention on AMX tiles (bfloat16 rows, Intel's tdpbf16ps) ---------------------------
 * For bfloat16 queries and caches where the tiles are there: the scores of 16 keys by the group's G
 * query heads in D / 32 tile products (the keys read as they lie in the cache, 16 rows of 32 values
 * a tile; the group's queries transposed once into the second operand), the softmax as above, and
 * the values' weighted sum as tile products too: the weights rounded to bfloat16 (as flash
 * attention rounds them; the divisor sums the rounded weights, so they still sum to one), the
 * values re-laid in pairs of keys for the second operand, float32 sums. Every element of a tile
 * product depends on its own row and column only and sums in an order fixed by the key range, so
 * the construction is as batch-invariant as the vector code above: a row equals its plain step bit
 * for bit, tree rows included (a block of keys with a mapped or missing position is gathered into
 * a buffer first: the same bytes, the same tile). Not the vector code's bits: the two are
 * different roundings of the same attention (q8_set_amx_attend chooses, for side-by-side runs). */
#if defined(Q8_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define Q8_AMX_ATTEND 1
static int amx_attend = 1;
void q8_set_amx_attend(int on) { amx_attend = on; }
int q8_attend_amx(void) { return amx_attend && q8_amx_available(); }

/* the scores' tiles: 0-3 the scores of 4 blocks of 16 keys (16 rows, G columns of float32); 4, 5:
 * 16 keys, 32 dims (64 bytes a row); 6, 7: the queries transposed (16 pairs of dims, G columns).
 * The outputs' tiles: 0-3 a group's outputs, 16 dims each (G rows of float32); 4: its weights, 32
 * keys (G rows of bfloat16); 5-7: 16 pairs of value rows, 16 dims (64 bytes a row). */
static void amx_attend_configure(int G, int outputs) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    if (outputs) {
        for (int t = 0; t < 5; t++) cfg.rows[t] = (uint8_t)G;
    } else {
        for (int t = 0; t < 4; t++) cfg.colsb[t] = (uint16_t)(4 * G);
        cfg.colsb[6] = cfg.colsb[7] = (uint16_t)(4 * G);
    }
    _tile_loadconfig(&cfg);
}

/* one kv head's G query heads of one row (bfloat16 everything, D a multiple of 64 up to 256, G <= 16).
 * Scratch: qt [D / 32][16][16] uint32, kb [4][16][D] bf16, ct [n + 64][16] float, s [G][n + 32] float,
 * pb [G][n rounded up to 32] bf16, vb [4][4][16][32] bf16, ob [G][64] float. */
static void attend_group_amx(const uint16_t *q, int64_t G, int64_t D, const uint16_t *k, const uint16_t *v,
                             int64_t kv_pos, int64_t start, int64_t end, const int64_t *map, int64_t base,
                             float scale, uint16_t *out, uint32_t *qt, uint16_t *kb, float *ct, float *s,
                             uint16_t *pb, uint16_t *vb, float *ob) {
    const int64_t n = end - start, np = (n + 31) / 32 * 32, KC = D / 32;
    /* the queries as the second operand: chunk c, row p, column i = dims 32c + 2p, 2p + 1 of head i */
    memset(qt, 0, sizeof(uint32_t) * (size_t)(KC * 256));
    const uint32_t *q32 = (const uint32_t *)q;
    for (int64_t i = 0; i < G; i++)
        for (int64_t c = 0; c < KC; c++)
            for (int p = 0; p < 16; p++) qt[(c * 16 + p) * 16 + i] = q32[(i * D) / 2 + c * 16 + p];
    const int contiguous_to = map ? (int)(base - start) : (int)n;  /* keys read in place below this */
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    amx_attend_configure((int)G, 0);
    if (KC == 2) { _tile_loadd(6, qt, 64); _tile_loadd(7, qt + 256, 64); }
    for (int64_t j00 = 0; j00 < n; j00 += 64) {
        const int blocks = (int)((n - j00 + 15) / 16 < 4 ? (n - j00 + 15) / 16 : 4);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int b = 0; b < blocks; b++) {
            const int64_t j0 = j00 + 16 * b;
            const int cnt = (int)(n - j0 < 16 ? n - j0 : 16);
            const uint16_t *kp;
            size_t stride;
            if (cnt == 16 && j0 + 16 <= contiguous_to) {
                kp = k + (size_t)((start + j0) * kv_pos);
                stride = (size_t)kv_pos * 2;
            } else {
                uint16_t *kbb = kb + (size_t)(b * 16 * D);
                memset(kbb, 0, sizeof(uint16_t) * (size_t)(16 * D));
                for (int jj = 0; jj < cnt; jj++)
                    memcpy(kbb + jj * D, k + (size_t)(KV_AT(start + j0 + jj) * kv_pos), sizeof(uint16_t) * (size_t)D);
                kp = kbb;
                stride = (size_t)D * 2;
            }
            /* tile numbers must be constants: one case per block */
#define SCORE_BLOCK(T) do { \
                if (KC == 2) { \
                    _tile_loadd(4, kp, stride); _tile_dpbf16ps(T, 4, 6); \
                    _tile_loadd(5, kp + 32, stride); _tile_dpbf16ps(T, 5, 7); \
                } else for (int64_t c = 0; c < KC; c += 2) { \
                    _tile_loadd(6, qt + c * 256, 64); _tile_loadd(4, kp + 32 * c, stride); _tile_dpbf16ps(T, 4, 6); \
                    _tile_loadd(7, qt + (c + 1) * 256, 64); _tile_loadd(5, kp + 32 * (c + 1), stride); _tile_dpbf16ps(T, 5, 7); \
                } } while (0)
            if (b == 0) SCORE_BLOCK(0); else if (b == 1) SCORE_BLOCK(1); else if (b == 2) SCORE_BLOCK(2); else SCORE_BLOCK(3);
#undef SCORE_BLOCK
        }
        _tile_stored(0, ct, 64); _tile_stored(1, ct + 256, 64); _tile_stored(2, ct + 512, 64); _tile_stored(3, ct + 768, 64);
        for (int b = 0; b < blocks; b++) {
            const int64_t j0 = j00 + 16 * b;
            const int cnt = (int)(n - j0 < 16 ? n - j0 : 16);
            const __mmask16 live = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1u);
            const __m512i at = _mm512_slli_epi32(lanes, 4);
            for (int64_t i = 0; i < G; i++) {
                const __m512 sc = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, _mm512_add_epi32(at, _mm512_set1_epi32((int)i)),
                                                           ct + 256 * b, 4);
                _mm512_mask_storeu_ps(s + i * n + j0, live, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
            }
        }
    }
    /* the weights, rounded to bfloat16, and their sums */
    float total[16];
    for (int64_t i = 0; i < G; i++) {
        float *si = s + i * n;
        uint16_t *pi = pb + i * np;
        const int64_t nv = n - n % 16;
        const __mmask16 tail = (__mmask16)((1u << (n - nv)) - 1u);
        const __m512 m = row_max(si, nv, tail);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < np; j += 16) {
            const __mmask16 on = j < nv ? (__mmask16)0xffffu : j == nv ? tail : (__mmask16)0;
            const __m512 p = _mm512_maskz_mov_ps(on, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(on, si + j), m)));
            const __m256bh h = _mm512_cvtneps_pbh(p);
            _mm256_storeu_si256((__m256i *)(pi + j), (__m256i)h);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)));
        }
        total[i] = _mm512_reduce_add_ps(sum);
    }
    /* the weighted values, 64 dims at a time: 32 keys a step, re-laid in pairs (row p of the tile
     * for dims 16t..16t+15: keys 2p and 2p + 1 interleaved) */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    amx_attend_configure((int)G, 1);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j0 = 0; j0 < np; j0 += 32) {
            uint16_t *vbb = vb + ((j0 / 32) & 3) * 2048;
            for (int p = 0; p < 16; p++) {
                const int64_t ja = j0 + 2 * p, jb = ja + 1;
                __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
                if (ja < n) {
                    const uint16_t *r = v + (size_t)(KV_AT(start + ja) * kv_pos) + d0;
                    a0 = _mm512_loadu_si512((const void *)r); a1 = _mm512_loadu_si512((const void *)(r + 32));
                }
                if (jb < n) {
                    const uint16_t *r = v + (size_t)(KV_AT(start + jb) * kv_pos) + d0;
                    b0 = _mm512_loadu_si512((const void *)r); b1 = _mm512_loadu_si512((const void *)(r + 32));
                }
                _mm512_storeu_si512((void *)(vbb + (0 * 16 + p) * 32), _mm512_permutex2var_epi16(a0, lo, b0));
                _mm512_storeu_si512((void *)(vbb + (1 * 16 + p) * 32), _mm512_permutex2var_epi16(a0, hi, b0));
                _mm512_storeu_si512((void *)(vbb + (2 * 16 + p) * 32), _mm512_permutex2var_epi16(a1, lo, b1));
                _mm512_storeu_si512((void *)(vbb + (3 * 16 + p) * 32), _mm512_permutex2var_epi16(a1, hi, b1));
            }
            _tile_loadd(4, pb + j0, (size_t)np * 2);
            _tile_loadd(5, vbb, 64); _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vbb + 512, 64); _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, vbb + 1024, 64); _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vbb + 1536, 64); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, ob, 256); _tile_stored(1, ob + 16, 256); _tile_stored(2, ob + 32, 256); _tile_stored(3, ob + 48, 256);
        for (int64_t i = 0; i < G; i++) {
            const __m512 t = _mm512_set1_ps(total[i]);
            for (int c = 0; c < 4; c++) {
                const __m512 o = _mm512_div_ps(_mm512_loadu_ps(ob + i * 64 + 16 * c), t);
                _mm256_storeu_si256((__m256i *)(out + i * D + d0 + 16 * c), (__m256i)_mm512_cvtneps_pbh(o));
            }
        }
    }
}
#else
void q8_set_amx_attend(int on) { (void)on; }
int q8_attend_amx(void) { return 0; }
#endif

/* the same in plain C (any D; libm's expf) */
static void attend_group_scalar(const void *q, int bf16, int64_t G, int64_t D, const void *k, const void *v,
                                int64_t kv_pos, int64_t start, int64_t end, const int64_t *map, int64_t base,
                                float scale, void *out, float *s) {
    const int64_t n = end - start;
    for (int64_t i = 0; i < G; i++) {
        float *si = s + i * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < D; d++)
                acc = acc + load_any(q, bf16, i * D + d) * load_any(k, bf16, KV_AT(start + j) * kv_pos + d);
            si[j] = acc * scale;
            m = si[j] > m ? si[j] : m;
        }
        float total = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            si[j] = expf(si[j] - m);
            total = total + si[j];
        }
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n; j++) acc = acc + si[j] * load_any(v, bf16, KV_AT(start + j) * kv_pos + d);
            store_any(out, bf16, i * D + d, acc / total);
        }
    }
}

/* returns 0, or -1 where scratch could not be allocated; slots (NULL for rows in the cache's order)
 * and off: each row's map of virtual positions from base on (see above) */
int q8_attend(const void *q, int bf16, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t q_row,
              const void *k, const void *v, int64_t kv_head, int64_t kv_pos, const int64_t *start,
              const int64_t *end, const int64_t *slots, const int64_t *off, int64_t base, float scale,
              void *out) {
    const int64_t G = H / Hkv;
    const size_t es = bf16 ? 2 : 4;
    int64_t longest = 1;
    for (int64_t r = 0; r < T; r++) longest = end[r] - start[r] > longest ? end[r] - start[r] : longest;
    float *s = (float *)malloc(sizeof(float) * (size_t)(G * (longest + 16) + G * D + 16 * D));
    if (!s) return -1;
    float *qf = s + G * (longest + 16), *kf = qf + G * D;
#if defined(Q8_AMX_ATTEND)
    const int on_tiles = bf16 && D % 64 == 0 && D <= 256 && G <= 16 && q8_attend_amx();
    void *tiles = NULL;
    if (on_tiles) {
        const int64_t np = (longest + 31) / 32 * 32;
        tiles = aligned_alloc(64, (size_t)(4 * (D / 32) * 256 + 2 * 64 * D + 4 * 16 * (np + 64) + 2 * G * np + 2 * 4 * 2048 + 4 * G * 64 + 64));
        if (!tiles) { free(s); return -1; }
    }
#endif
    for (int64_t r = 0; r < T; r++)
        for (int64_t g = 0; g < Hkv; g++) {
            const int64_t *map = slots ? slots + off[r] : NULL;
            const char *qg = (const char *)q + (size_t)(r * q_row + g * G * D) * es;
            const char *kg = (const char *)k + (size_t)(g * kv_head) * es;
            const char *vg = (const char *)v + (size_t)(g * kv_head) * es;
            char *og = (char *)out + (size_t)(r * H * D + g * G * D) * es;
#if defined(Q8_AMX_ATTEND)
            if (on_tiles) {
                const int64_t np = (longest + 31) / 32 * 32;
                uint32_t *qt = (uint32_t *)tiles;
                uint16_t *kb = (uint16_t *)(qt + (D / 32) * 256);
                float *ct = (float *)(kb + 64 * D);
                uint16_t *pb = (uint16_t *)(ct + 16 * (np + 64));
                uint16_t *vb = pb + G * np;
                float *ob = (float *)(vb + 4 * 2048);
                attend_group_amx((const uint16_t *)qg, G, D, (const uint16_t *)kg, (const uint16_t *)vg, kv_pos, start[r],
                                 end[r], map, base, scale, (uint16_t *)og, qt, kb, ct, s, pb, vb, ob);
                continue;
            }
#endif
#if defined(__AVX512F__)
            if (D == 64 && G <= 16) { attend_group_vec(qg, bf16, G, kg, vg, kv_pos, start[r], end[r], map, base, scale, og, qf, s, kf, 4); continue; }
            if (D == 128 && G <= 16) { attend_group_vec(qg, bf16, G, kg, vg, kv_pos, start[r], end[r], map, base, scale, og, qf, s, kf, 8); continue; }
            if (D == 256 && G <= 16) { attend_group_vec(qg, bf16, G, kg, vg, kv_pos, start[r], end[r], map, base, scale, og, qf, s, kf, 16); continue; }
#elif defined(__AVX2__) && defined(__FMA__)
            if (D % 8 == 0 && D <= 256 && G <= 16) {
                attend_group_avx2(qg, bf16, G, kg, vg, kv_pos, start[r], end[r], map, base, scale, og, qf, s, kf, (int)(D / 8));
                continue;
            }
#else
            (void)qf; (void)kf;
#endif
            attend_group_scalar(qg, bf16, G, D, kg, vg, kv_pos, start[r], end[r], map, base, scale, og, s);
        }
#if defined(Q8_AMX_ATTEND)
    free(tiles);
#endif
    free(s);
    return 0;
}

/* ---- logits ------------------------------------------------------------------------------------ */

/* The index of the first largest of x[0..n) (n >= 1), as torch.argmax gives it; -1 when x holds a
 * NaN (the caller asks torch then). Two passes: the largest value, then its first index. */
int64_t q8_argmax(const float *x, int64_t n) {
    float best = x[0];
    int64_t i = 0;
    int nan = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 vbest = _mm512_loadu_ps(x);
        __mmask16 vnan = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vbest = _mm512_max_ps(vbest, v);
        }
        nan = vnan != 0;
        best = _mm512_reduce_max_ps(vbest);
    }
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        best = x[i] > best ? x[i] : best;
    }
    if (nan) return -1;
    i = 0;
#if defined(__AVX512F__)
    const __m512 vb = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vb, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == best) return i;
    return -1;
}

/* y[0..n) rounded in place to bfloat16's precision, as float32 -> bfloat16 -> float32 rounds (round
 * to nearest, ties to even; a NaN becomes the quiet NaN bfloat16 has): an LM head's logits in the
 * precision of a bfloat16 target, without the two conversions. */
void q8_round_bf16(float *y, int64_t n) {
    uint32_t *u = (uint32_t *)y;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t v = u[i];
        const int nan = (v & 0x7fffffffu) > 0x7f800000u;
        const uint32_t r = (v + 0x7fffu + ((v >> 16) & 1u)) & 0xffff0000u;
        u[i] = nan ? 0x7fc00000u : r;
    }
}

/* ---- the lean forward's elementwise steps: the gated activation and the rotary embedding ----------
 * Each output element depends on its own inputs alone (no sums across a row), so a row's results
 * never depend on the other rows. Plain loops (-ffp-contract=off keeps every multiply and add
 * rounded as written), and the activation 16 or 8 lanes at a time where AVX-512 or AVX2 runs, by
 * the same operations in the same order as its scalar loop (its exponential is the attention's).
 * bfloat16 rows (bf16 != 0) are rounded after each operation that torch's bfloat16 operations
 * round after. */

/* exp_nonpositive and exp_nonpositive8 (the attention's) for one float: the same reduction and
 * polynomial by fused multiply-adds (fmaf rounds once, as theirs do), so the same bits as a lane of
 * theirs; x <= 0 */
static inline float exp_nonpositive1(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693145751953125f, x);
    r = fmaf(-n, 1.42860682030941723212e-6f, r);
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { uint32_t u; float f; } s = {.u = (uint32_t)((int32_t)n + 127) << 23};  /* 2^n, n >= -126 */
    return p * s.f;
}

/* silu(g) = g / (1 + e^-g), as g * e / (1 + e) with e = e^g below zero: the exponential of -|g| only */
static inline float silu1(float g) {
    const float e = exp_nonpositive1(-fabsf(g));
    return (g < 0.0f ? g * e : g) / (1.0f + e);
}

#if defined(__AVX512F__)
/* silu1(g) * u of 16 lanes (bf16: silu rounded to bfloat16 first), by the same operations */
static inline __m512 silu_mul16(__m512 g, __m512 u, int bf16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
    __m512 s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    if (bf16) s = bf16x16_round(s);
    return _mm512_mul_ps(s, u);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* silu1(g) * u of 8 float32 lanes, by the same operations */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  /* -|g| */
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
#endif

/* y [rows][width] = silu(gu[:, :width]) * gu[:, width:] for gate-and-up rows gu [rows][2 width]
 * (silu1): a gated MLP's activation in one pass instead of three tensor
 * operations. bfloat16: silu(g) is rounded to bfloat16, then the product (torch's two roundings). */
void q8_silu_mul(const void *gu, int bf16, int64_t rows, int64_t width, void *y) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t j0 = 0;
#if defined(__AVX512F__)
        for (; j0 + 16 <= width; j0 += 16) {
            if (bf16) {
                const uint16_t *g = (const uint16_t *)gu + r * 2 * width + j0;
                bf16x16_store((uint16_t *)y + r * width + j0,
                              silu_mul16(bf16x16_load(g), bf16x16_load(g + width), 1));
            } else {
                const float *g = (const float *)gu + r * 2 * width + j0;
                _mm512_storeu_ps((float *)y + r * width + j0,
                                 silu_mul16(_mm512_loadu_ps(g), _mm512_loadu_ps(g + width), 0));
            }
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; !bf16 && j0 + 8 <= width; j0 += 8) {
            const float *g = (const float *)gu + r * 2 * width + j0;
            _mm256_storeu_ps((float *)y + r * width + j0, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(g + width)));
        }
#endif
        for (int64_t j = j0; j < width; j++) {
            const float s = to_dtype(silu1(load_any(gu, bf16, r * 2 * width + j)), bf16);
            store_any(y, bf16, r * width + j, s * load_any(gu, bf16, r * 2 * width + width + j));
        }
    }
}

/* y [rows][heads][d] = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2]), for x
 * rows of `heads` heads of d (row r at x + r * row_stride elements, its heads contiguous) and one
 * cos and sin row of d per row (at cos + r * cs_stride, sin + r * cs_stride) shared by its heads:
 * the rotary embedding in one pass instead of five tensor operations, rounded as torch's
 * bfloat16 operations round (each product, then the sum). */
void q8_rope(const void *x, int bf16, int64_t rows, int64_t heads, int64_t d, int64_t row_stride,
             const void *cos, const void *sin, int64_t cs_stride, void *y) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = r * row_stride + h * d, out = (r * heads + h) * d, cs = r * cs_stride;
            for (int64_t j = 0; j < d; j++) {
                const float o = j < half ? -load_any(x, bf16, in + j + half) : load_any(x, bf16, in + j - half);
                store_any(y, bf16, out + j, to_dtype(load_any(x, bf16, in + j) * load_any(cos, bf16, cs + j), bf16) +
                                            to_dtype(o * load_any(sin, bf16, cs + j), bf16));
            }
        }
}
