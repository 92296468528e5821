/* The int8-activation product (kernels/q8_linear.c, q8_linear_u8) by row count, with its weights
 * read from memory as a forward reads them: COPIES weight matrices of N x K (random int8) are
 * multiplied in turn, each call timed over all of them, the best of 7 passes per row count.
 *
 *   gcc -O3 -march=native -ffp-contract=off -fno-fast-math -o /tmp/q8_rows \
 *       scripts/q8_rows_bench.c core/runtime/kernels/q8_linear.c -lm
 *   /tmp/q8_rows 896 4864 24      # Qwen2.5-0.5B's down product, its 24 layers
 *   /tmp/q8_rows 9728 896 24      # its fused gate-up product
 *
 * Link it against an earlier version of the kernel (git show REV:core/runtime/kernels/q8_linear.c)
 * to compare the two in one run. Timing only: the weights' layout does not change the bytes read. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void q8_linear_u8(const void *x, int bf16, int64_t M, int64_t K, int64_t Kp, const int8_t *packed,
                  const int32_t *wsum, const float *scale, const float *bias, int64_t N, float *y, int threads,
                  uint8_t *xq, float *sx);
int q8_u8_available(void);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s N K COPIES\n", argv[0]);
        return 2;
    }
    if (!q8_u8_available()) {
        fprintf(stderr, "8-bit activations need AVX-512 VNNI\n");
        return 1;
    }
    const int64_t N = atol(argv[1]), K = atol(argv[2]), Kp = (K + 63) / 64 * 64;
    const int copies = atoi(argv[3]);
    int8_t **w = malloc(sizeof(int8_t *) * (size_t)copies);
    for (int c = 0; c < copies; c++) {
        w[c] = aligned_alloc(64, (size_t)(((N + 3) / 4 * 4) * Kp));
        for (int64_t i = 0; i < (N + 3) / 4 * 4 * Kp; i++) w[c][i] = (int8_t)(rand() % 255 - 127);
    }
    int32_t *wsum = calloc((size_t)N, sizeof(int32_t));
    float *scale = malloc(sizeof(float) * (size_t)N), *x = malloc(sizeof(float) * (size_t)(8 * K));
    float *y = malloc(sizeof(float) * (size_t)(8 * N)), sx[8];
    uint8_t *xq = aligned_alloc(64, (size_t)(8 * Kp));
    for (int64_t i = 0; i < N; i++) scale[i] = 0.01f;
    for (int64_t i = 0; i < 8 * K; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    const int rows[] = {1, 2, 4, 6, 8};
    printf("| rows | ms per product (N=%ld, K=%ld, %d copies) | GB/s of weights |\n|---|---|---|\n", (long)N, (long)K, copies);
    for (int r = 0; r < 5; r++) {
        double best = 1e9;
        for (int pass = 0; pass < 7; pass++) {
            const double t0 = now();
            for (int c = 0; c < copies; c++) q8_linear_u8(x, 0, rows[r], K, Kp, w[c], wsum, scale, NULL, N, y, 1, xq, sx);
            const double t = (now() - t0) / copies;
            best = t < best ? t : best;
        }
        printf("| %d | %.3f | %.1f |\n", rows[r], 1e3 * best, (double)(N * Kp) / best / 1e9);
    }
    return 0;
}
