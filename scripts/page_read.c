/* How fast one core reads a file's first 480 MB from three kinds of memory: the file's own mapping
 * (page cache, 4 KiB pages: how a saved image's tensors are mapped), a private anonymous copy
 * advised MADV_HUGEPAGE (what dynaspec.runtime.q8.huge_pages moves the int8 weights into), and a
 * private anonymous copy advised against huge pages. Five rounds, each reading all three; then how
 * much of the process the kernel backed with huge pages.
 *
 *     cc -O2 -march=native -o page_read scripts/page_read.c
 *     ./page_read IMAGE_FOLDER/tensors.safetensors     (the folder: under ~/.cache/dynaspec/images)
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* every 64-byte line read once (the sum keeps the loads from being dropped) */
static long long read_all(const char *p, size_t n) {
    __m512i a = _mm512_setzero_si512();
    for (size_t i = 0; i < n; i += 64) a = _mm512_add_epi64(a, _mm512_load_si512((const void *)(p + i)));
    return _mm512_reduce_add_epi64(a);
}

int main(int argc, char **argv) {
    const size_t n = (size_t)480 << 20;
    if (argc < 2) {
        fprintf(stderr, "usage: page_read FILE (480 MB at least)\n");
        return 2;
    }
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0 || lseek(fd, 0, SEEK_END) < (off_t)n) {
        fprintf(stderr, "page_read: %s cannot be read or holds less than 480 MB\n", argv[1]);
        return 2;
    }
    char *file = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
    char *huge = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *small = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (file == MAP_FAILED || huge == MAP_FAILED || small == MAP_FAILED) {
        perror("page_read: mmap");
        return 1;
    }
    madvise(huge, n, MADV_HUGEPAGE);
    madvise(small, n, MADV_NOHUGEPAGE);
    memcpy(huge, file, n);
    memcpy(small, file, n);
    long long sum = 0;
    for (int round = 0; round < 5; round++) {
        double t0 = now();
        sum += read_all(file, n);
        double t1 = now();
        sum += read_all(huge, n);
        double t2 = now();
        sum += read_all(small, n);
        double t3 = now();
        printf("file mapping %.1f ms (%.1f GB/s)   huge pages %.1f ms (%.1f GB/s)   4 KiB pages %.1f ms (%.1f GB/s)\n",
               (t1 - t0) * 1e3, n / (t1 - t0) / 1e9, (t2 - t1) * 1e3, n / (t2 - t1) / 1e9, (t3 - t2) * 1e3,
               n / (t3 - t2) / 1e9);
    }
    FILE *maps = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (maps && fgets(line, sizeof line, maps))
        if (strstr(line, "AnonHugePages")) fputs(line, stdout);
    return sum == 42;
}
