/* CPU kernels for NeuroAda's sparse bypass (float32).
 *
 * Built on first use by peft_neuroada/native.py with the system C compiler and loaded with ctypes after torch, so
 * `#pragma omp` shares torch's OpenMP runtime and thread count. Placement of one adapter: delta (n, k) row-major,
 * cols (n, k) int32 input columns, rows (n,) int32 output rows or NULL for rows 0..n-1.
 */
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define VECTORISED __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define VECTORISED
#endif

/* Work below this many multiply-adds runs on the calling thread: a parallel region costs more than it saves. */
#define PARALLEL_MIN_WORK 65536

static inline int64_t row_of(const int32_t *rows, int64_t i) { return rows ? rows[i] : i; }

/* originals[i, j] = w[row_i, cols[i, j]]; w[row_i, cols[i, j]] += delta[i, j]. One pass over the placed entries. */
void neuroada_add_deltas(float *w, int64_t row_stride, int64_t col_stride, const int32_t *rows, const int32_t *cols,
                         const float *delta, float *originals, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < n; i++) {
        float *row = w + row_of(rows, i) * row_stride;
        for (int64_t j = 0; j < k; j++) {
            float *entry = row + (int64_t)cols[i * k + j] * col_stride;
            originals[i * k + j] = *entry;
            *entry += delta[i * k + j];
        }
    }
}

/* w[row_i, cols[i, j]] = values[i, j]. */
void neuroada_write_entries(float *w, int64_t row_stride, int64_t col_stride, const int32_t *rows,
                            const int32_t *cols, const float *values, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < n; i++) {
        float *row = w + row_of(rows, i) * row_stride;
        for (int64_t j = 0; j < k; j++) row[(int64_t)cols[i * k + j] * col_stride] = values[i * k + j];
    }
}

/* A token block of the sampled product: out[p] += sum_b gT[p / k, b] * xT[cols[p], b] for every pair p = (i, j).
 * Four pairs at a time: four independent accumulator chains hide the FMA latency that a single dot product waits on. */
VECTORISED static void sampled_block(const float *xT, const float *gT, const int32_t *cols, float *out, int64_t n,
                                     int64_t k, int64_t block) {
    int64_t pairs = n * k, quads = pairs / 4;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < quads; q++) {
        int64_t p = 4 * q;
        const float *g0 = gT + (p / k) * block, *g1 = gT + ((p + 1) / k) * block;
        const float *g2 = gT + ((p + 2) / k) * block, *g3 = gT + ((p + 3) / k) * block;
        const float *x0 = xT + (int64_t)cols[p] * block, *x1 = xT + (int64_t)cols[p + 1] * block;
        const float *x2 = xT + (int64_t)cols[p + 2] * block, *x3 = xT + (int64_t)cols[p + 3] * block;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t b = 0; b < block; b++) {
            a0 += g0[b] * x0[b];
            a1 += g1[b] * x1[b];
            a2 += g2[b] * x2[b];
            a3 += g3[b] * x3[b];
        }
        out[p] += a0;
        out[p + 1] += a1;
        out[p + 2] += a2;
        out[p + 3] += a3;
    }
#pragma omp single
    for (int64_t p = 4 * quads; p < pairs; p++) {
        const float *g = gT + (p / k) * block, *x = xT + (int64_t)cols[p] * block;
        float acc = 0.f;
        for (int64_t b = 0; b < block; b++) acc += g[b] * x[b];
        out[p] += acc;
    }
}

/* Copy rows t0..t0+block of a (tokens, width) matrix (unit column stride) into a (columns, block) buffer, taking
 * the listed columns (or all of them when `columns` is NULL). Tiles of 16 columns read each cache line once. */
static void transpose_block(const float *src, int64_t row_stride, int64_t t0, int64_t block, const int32_t *columns,
                            int64_t width, float *dst) {
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
        int64_t c1 = c0 + 16 < width ? c0 + 16 : width;
        for (int64_t b = 0; b < block; b++) {
            const float *row = src + (t0 + b) * row_stride;
            for (int64_t c = c0; c < c1; c++) dst[c * block + b] = row[row_of(columns, c)];
        }
    }
}

/* The dense weight gradient g^T x sampled at the placement, without forming it:
 *   out[i, j] = sum_t g[t, row_i] * x[t, cols[i, j]]      (x: tokens x d_in, g: tokens x d_out, unit column stride)
 * Tokens are walked in blocks whose transposed slices (xT_buf: d_in x block, gT_buf: n x block) stay in cache, so
 * every product is a short contiguous dot product and nothing of size tokens x n x k is ever formed. */
void neuroada_sampled_grad(const float *x, int64_t x_stride, int64_t d_in, const float *g, int64_t g_stride,
                           const int32_t *rows, const int32_t *cols, float *out, int64_t n, int64_t k, int64_t tokens,
                           int64_t block, float *xT_buf, float *gT_buf) {
    memset(out, 0, sizeof(float) * n * k);
#pragma omp parallel if (n * k * tokens >= PARALLEL_MIN_WORK)
    for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        int64_t size = tokens - t0 < block ? tokens - t0 : block;
        transpose_block(x, x_stride, t0, size, NULL, d_in, xT_buf);
        transpose_block(g, g_stride, t0, size, rows, n, gT_buf);
        sampled_block(xT_buf, gT_buf, cols, out, n, k, size);
    }
}
