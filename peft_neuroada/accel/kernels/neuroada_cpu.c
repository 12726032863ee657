/* CPU kernels for NeuroAda's three sparse products (see cpu.py for the Python side and the layouts).
 *
 * Plain C99 + GCC/Clang vector extensions (no torch headers: builds in about a second), compiled on first use with
 * -O3 -march=native and loaded through ctypes, which releases the GIL during each call. Every call allocates its own
 * scratch and runs on its calling thread's OpenMP team (or its own pthreads where OpenMP is missing), so concurrent
 * calls from several Python threads are independent.
 *
 * Shapes: x (T, d_in), g (T, d_out), any strides; cols (n, k) and rows (n,) int16, int32 or int64, contiguous; rows
 * NULL means rows = arange(n) with n = d_out. Element types: 0 float32, 1 bfloat16, 2 float16. Every index is checked
 * before anything is written: a bad one returns NA_BAD_COLUMN or NA_BAD_ROW and leaves the outputs untouched.
 *
 * Layouts. Tokens are walked in blocks of `tb` (a multiple of the vector width), packed into float32 scratch with 8 x 8
 * register transposes (and converted from bfloat16/float16 on the way):
 *  - delta gradient: x^T and g^T of the block (feature-major, token-minor); every neuron's gradient row is read once
 *    for its k columns: k dot products of length tb over rows of x^T that stay in L2, four columns at a time. For
 *    k = 1 in float32 the "gather" layout serves (cpu.py says why): per token, vectors of
 *    neurons gather their inputs from the token's row of x and multiply them by the token's gradient row, with no
 *    transposes (small token blocks keep the rows gathered from in L1).
 *  - forward: x^T of the block; each neuron accumulates its k scaled input rows into a row of y^T, which is
 *    transposed out into y. At k = 1 the "gather" layout is faster: per token, vectors over 16 (AVX-512) or 8
 *    neurons gather their inputs from the token's row of x held in L1, with no transposes.
 *  - input gradient: the transpose of the forward, column by column: the placement's entries are first listed by
 *    input column (once per call); per block, g^T is packed and each input column sums its entries' scaled
 *    gradient rows in registers into its row of gx^T (written once), which is transposed out into gx.
 * Threads split the token blocks; the delta gradient adds per-thread partial sums at the end.
 */
#ifdef _OPENMP
#include <omp.h>
#else
#include <pthread.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define NA_OK 0
#define NA_BAD_COLUMN 1
#define NA_NO_MEMORY 2
#define NA_BAD_ARGUMENT 3
#define NA_BAD_ROW 4
#define NA_PATCHED 5

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef int32_t viu __attribute__((vector_size(VW * 4), aligned(4)));

enum { F32 = 0, BF16 = 1, F16 = 2 };

int na_vector_width(void) { return VW; }
#ifdef _OPENMP
int na_uses_openmp(void) { return 1; }
#else
int na_uses_openmp(void) { return 0; }
#endif
/* Leading dimension of a packed feature-major block: one vector more than the block, so that its rows do not all map
 * to the same cache sets (a power-of-two stride made tb = 256 blocks 3-6x slower). */
#define LD(tb) ((tb) + VW)
/* Vectors per full token block: the block the dot layouts are unrolled for (cpu.py passes them tb = 64). */
#define FULL_VECS (64 / VW)
/* The most columns per neuron the delta gradient's gather layout takes: its accumulators live in registers. */
#define GATHER_GRAD_MAX_K 8

/* ------------------------------------------------------------------------------------------- element conversion */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet: as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
    if (absu < 0x38800000u) {                                   /* subnormal or zero in half precision */
        float a;
        memcpy(&a, &absu, 4);
        return (uint16_t)(sign | (uint16_t)__builtin_lrintf(a * 16777216.0f));
    }
    uint32_t r = absu + 0x0fffu + ((absu >> 13) & 1u) - 0x38000000u;
    return (uint16_t)(sign | (r >> 13));
#endif
}

static inline float load_elem(const void *base, int64_t offset, int dtype) {
    if (dtype == F32) return ((const float *)base)[offset];
    uint16_t h = ((const uint16_t *)base)[offset];
    return dtype == BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

static inline void store_elem(void *base, int64_t offset, int dtype, float v) {
    if (dtype == F32)
        ((float *)base)[offset] = v;
    else
        ((uint16_t *)base)[offset] = dtype == BF16 ? f32_to_bf16(v) : f32_to_f16(v);
}

/* ---------------------------------------------------------------------------------------------------- operands */

typedef struct {
    const void *data;
    int64_t s0, s1; /* element strides along tokens and features */
    int dtype;
} matrix;

typedef struct {
    int64_t T, d_in, d_out, n, k, tb;
    int32_t *cols;    /* (n, k), validated */
    int32_t *rows;    /* (n,), validated; NULL means arange */
    float *delta;     /* (n, k) float32, or NULL */
    int32_t *cols_t;  /* (k, n) for the gather layout, or NULL */
    float *delta_t;   /* (k, n) for the gather layout, or NULL */
} placement;

static void *aligned_buffer(int64_t floats) {
    size_t bytes = ((size_t)(floats > 0 ? floats : 1) * 4 + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

/* Copy an index array (int32, int64 or int16: itype 0, 1, 2) into int32; whether every index lies in [0, limit). */
static int indices_in_range(const void *src, int itype, int64_t count, int64_t limit, int32_t *dst) {
    int bad = 0;
    if (itype == 2) {
        const int16_t *s = (const int16_t *)src;
        for (int64_t e = 0; e < count; e++) {
            bad |= (s[e] < 0) | ((int64_t)s[e] >= limit);
            dst[e] = s[e];
        }
    } else if (itype == 0) {
        const int32_t *s = (const int32_t *)src;
        for (int64_t e = 0; e < count; e++) {
            bad |= (s[e] < 0) | ((int64_t)s[e] >= limit);
            dst[e] = s[e];
        }
    } else {
        const int64_t *s = (const int64_t *)src;
        for (int64_t e = 0; e < count; e++) {
            bad |= (s[e] < 0) | (s[e] >= limit);
            dst[e] = (int32_t)s[e];
        }
    }
    return !bad;
}

static void free_placement(placement *p) {
    free(p->cols);
    free(p->rows);
    free(p->delta);
    free(p->cols_t);
    free(p->delta_t);
}

static int make_placement(placement *p, const void *cols, int cdt, const void *rows, int rdt, const void *delta,
                          int ddt, int64_t T, int64_t d_in, int64_t d_out, int64_t n, int64_t k, int64_t tb,
                          int transposed) {
    memset(p, 0, sizeof(*p));
    if (T < 0 || d_in < 0 || d_out < 0 || n < 0 || k < 0 || tb <= 0 || tb % VW || tb > FULL_VECS * VW ||
        (rows == NULL && n != d_out))
        return NA_BAD_ARGUMENT;
    if (T < tb) tb = T > 0 ? (T + VW - 1) / VW * VW : VW; /* short inputs (decoding) get small scratch blocks */
    p->T = T, p->d_in = d_in, p->d_out = d_out, p->n = n, p->k = k, p->tb = tb;
    p->cols = aligned_buffer(n * k);
    if (!p->cols) return NA_NO_MEMORY;
    int status = indices_in_range(cols, cdt, n * k, d_in, p->cols) ? NA_OK : NA_BAD_COLUMN;
    if (status == NA_OK && rows) {
        p->rows = aligned_buffer(n);
        status = !p->rows ? NA_NO_MEMORY : indices_in_range(rows, rdt, n, d_out, p->rows) ? NA_OK : NA_BAD_ROW;
    }
    if (status == NA_OK && delta) {
        p->delta = aligned_buffer(n * k);
        if (!p->delta) return NA_NO_MEMORY;
        for (int64_t e = 0; e < n * k; e++) p->delta[e] = load_elem(delta, e, ddt);
    }
    if (status == NA_OK && transposed) { /* (k, n) copies, padded to whole vectors of neurons */
        int64_t np = (n + VW - 1) / VW * VW;
        p->cols_t = aligned_buffer(k * np);
        p->delta_t = aligned_buffer(k * np);
        if (!p->cols_t || !p->delta_t) return NA_NO_MEMORY;
        for (int64_t j = 0; j < k; j++)
            for (int64_t i = 0; i < np; i++) {
                p->cols_t[j * np + i] = i < n ? p->cols[i * k + j] : 0;
                p->delta_t[j * np + i] = i < n && p->delta ? p->delta[i * k + j] : 0.0f;
            }
    }
    return status;
}

/* -------------------------------------------------------------------------------------------------- threading */

typedef void (*block_fn)(void *ctx, int64_t begin, int64_t end, int worker);

/* Split [0, items) into `workers` contiguous ranges, one per thread; returns the workers used.
 *
 * Built with OpenMP (the default where the compiler has it), the ranges run on the calling thread's OpenMP team.
 * Inside a torch process that is torch's own libgomp (the loader matches the library by its soname), so the kernels
 * reuse torch's worker threads instead of starting threads that compete with those workers while they spin between
 * torch ops. A team smaller than asked for (OMP_THREAD_LIMIT, nesting) splits the range among the threads it has. */
#ifdef _OPENMP
static int parallel_for(int workers, int64_t items, block_fn fn, void *ctx) {
    if (workers > items) workers = (int)items;
    if (workers <= 1) {
        fn(ctx, 0, items, 0);
        return 1;
    }
#pragma omp parallel num_threads(workers)
    {
        int64_t team = omp_get_num_threads(), w = omp_get_thread_num();
        fn(ctx, items * w / team, items * (w + 1) / team, (int)w);
    }
    return workers;
}
#else
typedef struct {
    block_fn fn;
    void *ctx;
    int64_t begin, end;
    int worker;
} task;

static void *run_task(void *arg) {
    task *t = (task *)arg;
    t->fn(t->ctx, t->begin, t->end, t->worker);
    return NULL;
}

static int parallel_for(int workers, int64_t items, block_fn fn, void *ctx) {
    if (workers > items) workers = (int)items;
    if (workers < 1) workers = 1;
    task tasks[64];
    pthread_t threads[64];
    int started[64] = {0};
    if (workers > 64) workers = 64;
    for (int w = 0; w < workers; w++) {
        tasks[w] = (task){fn, ctx, items * w / workers, items * (w + 1) / workers, w};
        if (w > 0) started[w] = pthread_create(&threads[w], NULL, run_task, &tasks[w]) == 0;
    }
    run_task(&tasks[0]);
    for (int w = 1; w < workers; w++) {
        if (started[w])
            pthread_join(threads[w], NULL);
        else
            run_task(&tasks[w]); /* no thread available: do its share here */
    }
    return workers;
}
#endif

/* Threads worth starting: at most one per token block, and one per MIN_WORK multiply-adds and element moves (a thread
 * start costs tens of microseconds; decoding a token or two stays on the calling thread). */
#define MIN_WORK (1 << 18)
static int worker_count(int requested, int64_t blocks, int64_t work) {
    int64_t limit = work / MIN_WORK + 1;
    if (limit > blocks) limit = blocks;
    if (requested > limit) requested = (int)limit;
    return requested < 1 ? 1 : requested;
}

/* ------------------------------------------------------------------------------------------------ packing */

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v8hu __attribute__((vector_size(16), aligned(2)));

/* Eight contiguous elements as float32. */
static inline v8f load8(const void *base, int64_t offset, int dtype) {
    if (dtype == F32) return *(const v8fu *)((const float *)base + offset);
    v8h h = *(const v8hu *)((const uint16_t *)base + offset);
    if (dtype == BF16) return (v8f)(__builtin_convertvector(h, v8u) << 16);
#if defined(__F16C__)
    return (v8f)_mm256_cvtph_ps((__m128i)h);
#else
    v8f r;
    for (int l = 0; l < 8; l++) r[l] = f16_to_f32(h[l]);
    return r;
#endif
}

static inline void store8(void *base, int64_t offset, int dtype, v8f v) {
    if (dtype == F32) {
        *(v8fu *)((float *)base + offset) = v;
        return;
    }
    v8h h;
    if (dtype == BF16) {
        v8u u = (v8u)v;
        v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
        v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        h = __builtin_convertvector((rounded & ~nan) | (((u >> 16) | 0x40u) & nan), v8h);
    } else {
#if defined(__F16C__)
        h = (v8h)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
        for (int l = 0; l < 8; l++) h[l] = f32_to_f16(v[l]);
#endif
    }
    *(v8hu *)((uint16_t *)base + offset) = h;
}

/* In-register transpose of an 8 x 8 tile (unpack, shuffle, swap 128-bit halves). */
static inline void transpose8(v8f r[8]) {
    v8f t[8], u[8];
    for (int q = 0; q < 8; q += 2) {
        t[q] = __builtin_shufflevector(r[q], r[q + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[q + 1] = __builtin_shufflevector(r[q], r[q + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int q = 0; q < 8; q += 4) {
        u[q] = __builtin_shufflevector(t[q], t[q + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[q + 1] = __builtin_shufflevector(t[q], t[q + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[q + 2] = __builtin_shufflevector(t[q + 1], t[q + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[q + 3] = __builtin_shufflevector(t[q + 1], t[q + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int q = 0; q < 4; q++) {
        r[q] = __builtin_shufflevector(u[q], u[q + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[q + 4] = __builtin_shufflevector(u[q], u[q + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* dst[f * ld + t] = src[t0 + t, feature(f)] for t < len, zero for len <= t < round_up(len, VW): feature-major.
 * Row-major sources go through 8 x 8 register transposes; feature-major ones (x.T views) are row copies. */
static void pack_transposed(const matrix *src, int64_t t0, int64_t len, int64_t features, const int32_t *feature_map,
                            float *dst, int64_t ld) {
    int64_t padded = (len + VW - 1) / VW * VW, f_tiles = 0, t_tiles = 0;
    if (src->s1 == 1 && !feature_map) {
        /* 64 features (four cache lines of each source row) at a time, read row after row, so every source line is
         * used whole once and the 64 destination rows being filled stay in L1 */
        f_tiles = features / 8 * 8, t_tiles = len / 8 * 8;
        for (int64_t f0 = 0; f0 < f_tiles; f0 += 64) {
            int64_t f1 = f0 + 64 < f_tiles ? f0 + 64 : f_tiles;
            for (int64_t t = 0; t < t_tiles; t += 8)
                for (int64_t f = f0; f < f1; f += 8) {
                    v8f r[8];
                    for (int q = 0; q < 8; q++) r[q] = load8(src->data, (t0 + t + q) * src->s0 + f, src->dtype);
                    transpose8(r);
                    for (int q = 0; q < 8; q++) *(v8fu *)(dst + (f + q) * ld + t) = r[q];
                }
        }
    } else if (src->s0 == 1 && !feature_map) {
        f_tiles = features, t_tiles = len / 8 * 8;
        for (int64_t f = 0; f < features; f++)
            for (int64_t t = 0; t < t_tiles; t += 8)
                *(v8fu *)(dst + f * ld + t) = load8(src->data, t0 + t + f * src->s1, src->dtype);
    }
    /* the rest (edges, feature maps, other strides) element by element, a block of features at a time */
    const int64_t FB = 64;
    for (int64_t f0 = 0; f0 < features; f0 += FB) {
        int64_t f1 = f0 + FB < features ? f0 + FB : features;
        for (int64_t t = 0; t < len; t++) {
            int64_t row = (t0 + t) * src->s0;
            for (int64_t f = t < t_tiles ? (f0 > f_tiles ? f0 : f_tiles) : f0; f < f1; f++)
                dst[f * ld + t] = load_elem(src->data, row + (feature_map ? feature_map[f] : f) * src->s1, src->dtype);
        }
        for (int64_t f = f0; f < f1; f++)
            for (int64_t t = len; t < padded; t++) dst[f * ld + t] = 0.0f;
    }
}

/* dst[t0 + t, feature(f)] = src[f * ld + t] for t < len (dst row-major with unit feature stride): the inverse.
 * With `accumulate`, added to what dst holds (in float32, rounded once). */
static void unpack_transposed(const float *src, int64_t ld, int64_t t0, int64_t len, int64_t features,
                              const int32_t *feature_map, void *dst, int64_t ds0, int dtype, int accumulate) {
    int64_t f_tiles = 0, t_tiles = 0;
    if (!feature_map) {
        f_tiles = features / 8 * 8, t_tiles = len / 8 * 8;
        for (int64_t t = 0; t < t_tiles; t += 8)
            for (int64_t f = 0; f < f_tiles; f += 8) {
                v8f r[8];
                for (int q = 0; q < 8; q++) r[q] = *(const v8fu *)(src + (f + q) * ld + t);
                transpose8(r);
                for (int q = 0; q < 8; q++) {
                    int64_t offset = (t0 + t + q) * ds0 + f;
                    store8(dst, offset, dtype, accumulate ? r[q] + load8(dst, offset, dtype) : r[q]);
                }
            }
    }
    const int64_t FB = 64;
    for (int64_t f0 = 0; f0 < features; f0 += FB) {
        int64_t f1 = f0 + FB < features ? f0 + FB : features;
        for (int64_t t = 0; t < len; t++) {
            int64_t row = (t0 + t) * ds0;
            for (int64_t f = t < t_tiles ? (f0 > f_tiles ? f0 : f_tiles) : f0; f < f1; f++) {
                int64_t offset = row + (feature_map ? feature_map[f] : f);
                store_elem(dst, offset, dtype, src[f * ld + t] + (accumulate ? load_elem(dst, offset, dtype) : 0.0f));
            }
        }
    }
}

/* dst[t * width + f] = src[t0 + t, feature(f)] (token-major float32 rows), zero for n <= f < width. */
static void pack_rows(const matrix *src, int64_t t0, int64_t len, int64_t features, const int32_t *feature_map,
                      float *dst, int64_t width) {
    for (int64_t t = 0; t < len; t++) {
        int64_t row = (t0 + t) * src->s0;
        float *d = dst + t * width;
        if (src->dtype == F32 && src->s1 == 1 && !feature_map) {
            memcpy(d, (const float *)src->data + row, (size_t)features * 4);
        } else {
            for (int64_t f = 0; f < features; f++)
                d[f] = load_elem(src->data, row + (feature_map ? feature_map[f] : f) * src->s1, src->dtype);
        }
        for (int64_t f = features; f < width; f++) d[f] = 0.0f;
    }
}

static inline float hsum(vf v) {
#if VW == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12,
                                                                                             13, 14, 15);
#elif VW == 8
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = v;
#endif
#if VW >= 8
    typedef float v4 __attribute__((vector_size(16)));
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
    typedef float v4 __attribute__((vector_size(16)));
    v4 b = v;
#endif
    b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
    return b[0] + b[1];
}

/* o[q] += the lane sum of aq, q < 4: the four reductions share their shuffles (10-18% off the k = 20 delta gradient
 * against four separate lane sums, docs/performance-history.md). */
static inline void hsum4_into(vf a0, vf a1, vf a2, vf a3, float *restrict o) {
#if VW >= 8
    typedef float v4 __attribute__((vector_size(16)));
    typedef float v8 __attribute__((vector_size(32)));
#if VW == 16
    /* [a0 | a1] and [a2 | a3], each half the sum of its vector's two halves; then [a0 a1 a2 a3] by quarters */
    vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf c = __builtin_shufflevector(b01, b23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b01, b23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    v8 d = __builtin_shufflevector(c, c, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(c, c, 2, 3, 6, 7, 10, 11,
                                                                                                14, 15);
#else
    vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a0, a1, 4, 5, 6, 7,
                                                                                                  12, 13, 14, 15);
    vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a2, a3, 4, 5, 6, 7,
                                                                                                  12, 13, 14, 15);
    v8 d = __builtin_shufflevector(b01, b23, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b01, b23, 2, 3, 6, 7, 10, 11, 14, 15);
#endif
    v4 e = __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
    o[0] += e[0], o[1] += e[1], o[2] += e[2], o[3] += e[3];
#else
    o[0] += hsum(a0), o[1] += hsum(a1), o[2] += hsum(a2), o[3] += hsum(a3);
#endif
}

static inline vf gather(const float *base, vi idx) {
#if VW == 16
    return (vf)_mm512_i32gather_ps((__m512i)idx, base, 4);
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_i32gather_ps(base, (__m256i)idx, 4);
#else
    vf r;
    for (int l = 0; l < VW; l++) r[l] = base[idx[l]];
    return r;
#endif
}

/* ------------------------------------------------------------------------------------- delta gradient (SDDMM) */

typedef struct {
    const matrix *x, *g;
    const placement *p;
    float *out;     /* (n, k), written by worker 0 */
    float *partial; /* (workers - 1, n, k) for the other workers */
    double *phases; /* NULL, or seconds worker 0 spent packing x, packing g and in the products */
    int status;
} grad_ctx;

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One neuron's k dot products over a block: its gradient row (nv vectors) is loaded once and kept in registers while
 * the x^T rows of four columns at a time stream past. Inlined with nv a constant for full blocks (fully unrolled). */
static inline __attribute__((always_inline)) void grad_neuron(const vf *restrict gi, const float *restrict xt,
                                                              int64_t ld, const int32_t *restrict ci,
                                                              float *restrict oi, int64_t k, int64_t nv) {
    vf g[FULL_VECS];
    for (int64_t v = 0; v < nv; v++) g[v] = gi[v];
    int64_t j = 0;
    for (; j + 4 <= k; j += 4) {
        const vf *x0 = (const vf *)(xt + (int64_t)ci[j] * ld), *x1 = (const vf *)(xt + (int64_t)ci[j + 1] * ld),
                 *x2 = (const vf *)(xt + (int64_t)ci[j + 2] * ld), *x3 = (const vf *)(xt + (int64_t)ci[j + 3] * ld);
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t v = 0; v < nv; v++) a0 += g[v] * x0[v], a1 += g[v] * x1[v], a2 += g[v] * x2[v], a3 += g[v] * x3[v];
        hsum4_into(a0, a1, a2, a3, oi + j);
    }
    for (; j < k; j++) {
        const vf *x0 = (const vf *)(xt + (int64_t)ci[j] * ld);
        vf a0 = {0};
        for (int64_t v = 0; v < nv; v++) a0 += g[v] * x0[v];
        oi[j] += hsum(a0);
    }
}

static void grad_dot_blocks(void *arg, int64_t b0, int64_t b1, int worker) {
    grad_ctx *c = (grad_ctx *)arg;
    const placement *p = c->p;
    int64_t tb = p->tb, ld = LD(tb), n = p->n, k = p->k;
    float *out = worker == 0 ? c->out : c->partial + (worker - 1) * n * k;
    float *xt = aligned_buffer(p->d_in * ld), *gt = aligned_buffer(n * ld);
    if (!xt || !gt) {
        c->status = NA_NO_MEMORY;
        free(xt), free(gt);
        return;
    }
    double *phases = worker == 0 ? c->phases : NULL, t[4] = {0};
    for (int64_t b = b0; b < b1; b++) {
        int64_t t0 = b * tb, len = p->T - t0 < tb ? p->T - t0 : tb, nv = (len + VW - 1) / VW;
        if (phases) t[0] = seconds_now();
        pack_transposed(c->x, t0, len, p->d_in, NULL, xt, ld);
        if (phases) t[1] = seconds_now();
        pack_transposed(c->g, t0, len, n, p->rows, gt, ld);
        if (phases) t[2] = seconds_now();
        for (int64_t i = 0; i < n; i++) {
            const vf *gi = (const vf *)(gt + i * ld);
            if (nv == FULL_VECS)
                grad_neuron(gi, xt, ld, p->cols + i * k, out + i * k, k, FULL_VECS);
            else
                grad_neuron(gi, xt, ld, p->cols + i * k, out + i * k, k, nv);
        }
        if (phases) {
            t[3] = seconds_now();
            for (int q = 0; q < 3; q++) phases[q] += t[q + 1] - t[q];
        }
    }
    free(xt), free(gt);
}

/* The gather layout (k <= GATHER_GRAD_MAX_K): for each vector of VW neurons, k accumulators stay in registers over a
 * block of tokens, each adding the token's gradients times the inputs its columns gather from the token's row of x.
 * x and g are read where they lie when they are float32 rows (else a block of rows is converted first, element by
 * element: cpu.py takes this layout for float32 only). Each block's sums are added into (k, np) scratch, as the dot
 * layout adds its blocks' (one running sum over all tokens rounds several times worse), and transposed into the
 * worker's (n, k) sums at the end. */
static void grad_gather_blocks(void *arg, int64_t b0, int64_t b1, int worker) {
    grad_ctx *c = (grad_ctx *)arg;
    const placement *p = c->p;
    int64_t tb = p->tb, n = p->n, k = p->k, np = (n + VW - 1) / VW * VW, d_in = p->d_in;
    int x_rows = c->x->dtype == F32 && c->x->s1 == 1, g_rows = c->g->dtype == F32 && c->g->s1 == 1 && !p->rows;
    g_rows = g_rows && n == np; /* a vector of neurons reads whole vectors of gradients */
    float *acc = aligned_buffer(k * np), *xb = x_rows ? NULL : aligned_buffer(d_in * tb);
    float *gb = g_rows ? NULL : aligned_buffer(np * tb);
    if (!acc || (!x_rows && !xb) || (!g_rows && !gb)) {
        c->status = NA_NO_MEMORY;
        free(acc), free(xb), free(gb);
        return;
    }
    memset(acc, 0, (size_t)(k * np) * 4);
    double *phases = worker == 0 ? c->phases : NULL, t[4] = {0};
    for (int64_t b = b0; b < b1; b++) {
        int64_t t0 = b * tb, len = p->T - t0 < tb ? p->T - t0 : tb;
        if (phases) t[0] = seconds_now();
        if (!x_rows) pack_rows(c->x, t0, len, d_in, NULL, xb, d_in);
        if (phases) t[1] = seconds_now();
        if (!g_rows) pack_rows(c->g, t0, len, n, p->rows, gb, np);
        if (phases) t[2] = seconds_now();
        const float *xs = x_rows ? (const float *)c->x->data + t0 * c->x->s0 : xb;
        const float *gs = g_rows ? (const float *)c->g->data + t0 * c->g->s0 : gb;
        int64_t x_ld = x_rows ? c->x->s0 : d_in, g_ld = g_rows ? c->g->s0 : np;
        for (int64_t i0 = 0; i0 < np; i0 += VW) {
            vf a[GATHER_GRAD_MAX_K];
            vi idx[GATHER_GRAD_MAX_K];
            for (int64_t j = 0; j < k; j++) a[j] = (vf){0}, idx[j] = *(const vi *)(p->cols_t + j * np + i0);
            for (int64_t s = 0; s < len; s++) {
                vf gv = *(const vfu *)(gs + s * g_ld + i0);
                for (int64_t j = 0; j < k; j++) a[j] += gv * gather(xs + s * x_ld, idx[j]);
            }
            for (int64_t j = 0; j < k; j++) *(vf *)(acc + j * np + i0) += a[j];
        }
        if (phases) {
            t[3] = seconds_now();
            for (int q = 0; q < 3; q++) phases[q] += t[q + 1] - t[q];
        }
    }
    float *out = worker == 0 ? c->out : c->partial + (worker - 1) * n * k;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < k; j++) out[i * k + j] = acc[j * np + i];
    free(acc), free(xb), free(gb);
}

/* layout: 0 dot products, 1 gather (k <= GATHER_GRAD_MAX_K). */
int na_sampled_grad(const void *x, int64_t xs0, int64_t xs1, int xdt, const void *g, int64_t gs0, int64_t gs1,
                    int gdt, const void *cols, int cdt, const void *rows, int rdt, int64_t T, int64_t d_in,
                    int64_t d_out, int64_t n, int64_t k, float *out, int layout, int64_t tb, int workers,
                    double *phases) {
    if (layout == 1 && k > GATHER_GRAD_MAX_K) return NA_BAD_ARGUMENT;
    placement p;
    int status = make_placement(&p, cols, cdt, rows, rdt, NULL, 0, T, d_in, d_out, n, k, tb, layout == 1);
    if (status != NA_OK || n * k == 0) {
        free_placement(&p);
        return status;
    }
    matrix mx = {x, xs0, xs1, xdt}, mg = {g, gs0, gs1, gdt};
    int64_t blocks = (T + p.tb - 1) / p.tb, size = n * k;
    workers = worker_count(workers, blocks, T * (d_in + n + n * k));
    float *partial = workers > 1 ? aligned_buffer((workers - 1) * size) : NULL;
    if (workers > 1 && !partial) {
        free_placement(&p);
        return NA_NO_MEMORY;
    }
    memset(out, 0, (size_t)size * 4);
    if (partial) memset(partial, 0, (size_t)(workers - 1) * size * 4);
    grad_ctx ctx = {&mx, &mg, &p, out, partial, phases, NA_OK};
    parallel_for(workers, blocks, layout == 1 ? grad_gather_blocks : grad_dot_blocks, &ctx);
    for (int w = 1; w < workers; w++)
        for (int64_t e = 0; e < size; e++) out[e] += partial[(w - 1) * size + e];
    free(partial), free_placement(&p);
    return ctx.status;
}

/* ----------------------------------------------------------------------------------------- bypass forward (SpMM) */

typedef struct {
    const matrix *x;
    const placement *p;
    void *y;
    int ydt;
    int64_t ys0; /* y is (T, d_out) with unit feature stride */
    int accumulate; /* add into y (untuned outputs untouched) rather than overwrite it (untuned outputs zeroed) */
    int status;
} fwd_ctx;

static void store_token_columns(fwd_ctx *c, const float *yt_rows, int64_t t0, int64_t len, int64_t ld) {
    /* yt_rows: (n, ld) feature-major; into y rows t0..t0+len at the tuned columns, zero elsewhere. */
    const placement *p = c->p;
    if (p->rows && !c->accumulate)
        for (int64_t t = 0; t < len; t++)
            memset((char *)c->y + (t0 + t) * c->ys0 * (c->ydt == F32 ? 4 : 2), 0,
                   (size_t)p->d_out * (c->ydt == F32 ? 4 : 2));
    unpack_transposed(yt_rows, ld, t0, len, p->n, p->rows, c->y, c->ys0, c->ydt, c->accumulate);
}

/* out = sum over e < count of scale[e] * the packed block's row index[e], in nv registers, added in order: a neuron's
 * output from its k x^T rows (forward), an input column's gradient from its entries' g^T rows (input gradient). */
static inline __attribute__((always_inline)) void scaled_rows_sum(const float *restrict block, int64_t ld,
                                                                  const int32_t *restrict index,
                                                                  const float *restrict scale, int64_t count,
                                                                  vf *restrict out, int64_t nv) {
    vf a[FULL_VECS] = {{0}};
    for (int64_t e = 0; e < count; e++) {
        const vf *row = (const vf *)(block + (int64_t)index[e] * ld);
        float d = scale[e];
        for (int64_t v = 0; v < nv; v++) a[v] += d * row[v];
    }
    for (int64_t v = 0; v < nv; v++) out[v] = a[v];
}

static void fwd_dot_blocks(void *arg, int64_t b0, int64_t b1, int worker) {
    (void)worker;
    fwd_ctx *c = (fwd_ctx *)arg;
    const placement *p = c->p;
    int64_t tb = p->tb, ld = LD(tb), n = p->n, k = p->k;
    float *xt = aligned_buffer(p->d_in * ld), *yt = aligned_buffer(n * ld);
    if (!xt || !yt) {
        c->status = NA_NO_MEMORY;
        free(xt), free(yt);
        return;
    }
    for (int64_t b = b0; b < b1; b++) {
        int64_t t0 = b * tb, len = p->T - t0 < tb ? p->T - t0 : tb, nv = (len + VW - 1) / VW;
        pack_transposed(c->x, t0, len, p->d_in, NULL, xt, ld);
        for (int64_t i = 0; i < n; i++) {
            vf *yi = (vf *)(yt + i * ld);
            if (nv == FULL_VECS)
                scaled_rows_sum(xt, ld, p->cols + i * k, p->delta + i * k, k, yi, FULL_VECS);
            else
                scaled_rows_sum(xt, ld, p->cols + i * k, p->delta + i * k, k, yi, nv);
        }
        store_token_columns(c, yt, t0, len, ld);
    }
    free(xt), free(yt);
}

static void fwd_gather_blocks(void *arg, int64_t b0, int64_t b1, int worker) {
    (void)worker;
    fwd_ctx *c = (fwd_ctx *)arg;
    const placement *p = c->p;
    int64_t tb = p->tb, n = p->n, k = p->k, np = (n + VW - 1) / VW * VW, d_in = p->d_in;
    float *xr = aligned_buffer(d_in * tb), *yr = aligned_buffer(np);
    if (!xr || !yr) {
        c->status = NA_NO_MEMORY;
        free(xr), free(yr);
        return;
    }
    for (int64_t b = b0; b < b1; b++) {
        int64_t t0 = b * tb, len = p->T - t0 < tb ? p->T - t0 : tb;
        pack_rows(c->x, t0, len, d_in, NULL, xr, d_in);
        for (int64_t t = 0; t < len; t++) {
            const float *xt = xr + t * d_in;
            int direct = c->ydt == F32 && !p->rows && n % VW == 0;
            float *dst = direct ? (float *)c->y + (t0 + t) * c->ys0 : yr;
            for (int64_t i0 = 0; i0 < np; i0 += VW) {
                vf acc = {0};
                for (int64_t j = 0; j < k; j++)
                    acc += *(const vf *)(p->delta_t + j * np + i0) * gather(xt, *(const vi *)(p->cols_t + j * np + i0));
                *(vfu *)(dst + i0) = direct && c->accumulate ? acc + *(vfu *)(dst + i0) : acc;
            }
            if (!direct) {
                int64_t row = (t0 + t) * c->ys0;
                if (p->rows && !c->accumulate)
                    memset((char *)c->y + row * (c->ydt == F32 ? 4 : 2), 0, (size_t)p->d_out * (c->ydt == F32 ? 4 : 2));
                for (int64_t i = 0; i < n; i++) {
                    int64_t offset = row + (p->rows ? p->rows[i] : i);
                    store_elem(c->y, offset, c->ydt, yr[i] + (c->accumulate ? load_elem(c->y, offset, c->ydt) : 0.0f));
                }
            }
        }
    }
    free(xr), free(yr);
}

int na_bypass_forward(const void *x, int64_t xs0, int64_t xs1, int xdt, const void *cols, int cdt, const void *rows,
                      int rdt, const void *delta, int ddt, int64_t T, int64_t d_in, int64_t d_out, int64_t n, int64_t k,
                      void *y, int ydt, int64_t ys0, int accumulate, int layout, int64_t tb, int workers) {
    placement p;
    int status = make_placement(&p, cols, cdt, rows, rdt, delta, ddt, T, d_in, d_out, n, k, tb, layout == 1);
    if (status == NA_OK) {
        matrix mx = {x, xs0, xs1, xdt};
        fwd_ctx ctx = {&mx, &p, y, ydt, ys0, accumulate, NA_OK};
        int64_t blocks = (T + p.tb - 1) / p.tb;
        parallel_for(worker_count(workers, blocks, T * (p.d_in + n + n * k)), blocks,
                     layout == 1 ? fwd_gather_blocks : fwd_dot_blocks, &ctx);
        status = ctx.status;
    }
    free_placement(&p);
    return status;
}

/* ------------------------------------------------------------------------------------- bypass input gradient */

/* The placement's entries listed by input column (CSC): column c's are [start[c], start[c + 1]), each with its
 * neuron (a row of the packed g^T) and its delta, in neuron order, so that a column sums in the order a scatter over
 * neurons would. With them each row of gx^T is summed in registers and written once; scattering each neuron's row
 * into its k columns instead (a read-modify-write of gx^T per entry) took 1.3-1.7x as long at k = 20 on an AVX-512
 * Xeon (docs/performance-history.md). */
typedef struct {
    int32_t *start, *neuron;
    float *delta;
} column_entries;

static void free_column_entries(column_entries *e) {
    free(e->start), free(e->neuron), free(e->delta);
}

static int list_by_column(const placement *p, column_entries *e) {
    int64_t entries = p->n * p->k;
    if (!p->delta || entries > INT32_MAX) return NA_BAD_ARGUMENT;
    e->start = calloc((size_t)p->d_in + 1, sizeof(int32_t));
    e->neuron = malloc((size_t)(entries > 0 ? entries : 1) * sizeof(int32_t));
    e->delta = malloc((size_t)(entries > 0 ? entries : 1) * sizeof(float));
    int32_t *next = malloc((size_t)(p->d_in > 0 ? p->d_in : 1) * sizeof(int32_t));
    if (!e->start || !e->neuron || !e->delta || !next) {
        free(next);
        return NA_NO_MEMORY;
    }
    for (int64_t x = 0; x < entries; x++) e->start[p->cols[x] + 1]++;
    for (int64_t c = 0; c < p->d_in; c++) e->start[c + 1] += e->start[c];
    memcpy(next, e->start, (size_t)p->d_in * sizeof(int32_t));
    for (int64_t i = 0; i < p->n; i++)
        for (int64_t j = 0; j < p->k; j++) {
            int32_t slot = next[p->cols[i * p->k + j]]++;
            e->neuron[slot] = (int32_t)i, e->delta[slot] = p->delta[i * p->k + j];
        }
    free(next);
    return NA_OK;
}

typedef struct {
    const matrix *g;
    const placement *p;
    const column_entries *by_column;
    void *gx;
    int gxdt;
    int64_t gxs0;
    int accumulate;
    int status;
} igrad_ctx;

static void igrad_blocks(void *arg, int64_t b0, int64_t b1, int worker) {
    (void)worker;
    igrad_ctx *c = (igrad_ctx *)arg;
    const placement *p = c->p;
    const column_entries *e = c->by_column;
    int64_t tb = p->tb, ld = LD(tb), n = p->n, d_in = p->d_in;
    float *gt = aligned_buffer(n * ld), *gxt = aligned_buffer(d_in * ld);
    if (!gt || !gxt) {
        c->status = NA_NO_MEMORY;
        free(gt), free(gxt);
        return;
    }
    for (int64_t b = b0; b < b1; b++) {
        int64_t t0 = b * tb, len = p->T - t0 < tb ? p->T - t0 : tb, nv = (len + VW - 1) / VW;
        pack_transposed(c->g, t0, len, n, p->rows, gt, ld);
        for (int64_t f = 0; f < d_in; f++) { /* a column without entries stores zeros */
            int64_t first = e->start[f], count = e->start[f + 1] - first;
            vf *out = (vf *)(gxt + f * ld);
            if (nv == FULL_VECS)
                scaled_rows_sum(gt, ld, e->neuron + first, e->delta + first, count, out, FULL_VECS);
            else
                scaled_rows_sum(gt, ld, e->neuron + first, e->delta + first, count, out, nv);
        }
        unpack_transposed(gxt, ld, t0, len, d_in, NULL, c->gx, c->gxs0, c->gxdt, c->accumulate);
    }
    free(gt), free(gxt);
}

int na_bypass_input_grad(const void *g, int64_t gs0, int64_t gs1, int gdt, const void *cols, int cdt,
                         const void *rows, int rdt, const void *delta, int ddt, int64_t T, int64_t d_in, int64_t d_out,
                         int64_t n, int64_t k, void *gx, int gxdt, int64_t gxs0, int accumulate, int64_t tb,
                         int workers) {
    placement p;
    column_entries by_column = {NULL, NULL, NULL};
    int status = make_placement(&p, cols, cdt, rows, rdt, delta, ddt, T, d_in, d_out, n, k, tb, 0);
    if (status == NA_OK) status = list_by_column(&p, &by_column);
    if (status == NA_OK) {
        matrix mg = {g, gs0, gs1, gdt};
        igrad_ctx ctx = {&mg, &p, &by_column, gx, gxdt, gxs0, accumulate, NA_OK};
        int64_t blocks = (T + p.tb - 1) / p.tb;
        parallel_for(worker_count(workers, blocks, T * (d_in + n + n * k)), blocks, igrad_blocks, &ctx);
        status = ctx.status;
    }
    free_column_entries(&by_column);
    free_placement(&p);
    return status;
}

/* --------------------------------------------------------------------------- in-place path: the weight's entries */

/* The in-place path adds the deltas into the selected entries of the weight for one matmul and writes the saved
 * values back afterwards. A layer's weight is cold when the layer is visited, so nearly every entry is a cache
 * miss; one pass that saves and patches each entry, with the rows split across the calling thread's OpenMP team,
 * overlaps the misses of several cores (torch's gather and scatter_ run such small ops on one thread, in two passes).
 *
 * `patch_state` makes the pair safe to call from Python's try/finally: na_patch_entries allocates the saved values and
 * sets `applied` once the indices are checked, right before it writes; na_restore_entries writes them back and frees
 * them only when it is set (and then clears it), so a restore after a patch that never ran, or failed its check,
 * changes nothing. A patch while the state is applied (a nested visit) is refused before anything is written. */

typedef struct {
    int32_t applied;
    void *saved; /* (n, k) entries as they were, in the weight's element type; owned while applied */
} patch_state;

static inline int64_t index_at(const void *src, int itype, int64_t e) {
    if (itype == 2) return ((const int16_t *)src)[e];
    return itype == 0 ? ((const int32_t *)src)[e] : ((const int64_t *)src)[e];
}

typedef struct {
    void *w;
    int64_t s0, s1, k;
    int wdt; /* the weight's element type */
    const void *cols, *rows;
    int cdt, rdt;
    const void *delta; /* NULL: write `saved` back */
    int ddt;
    void *saved;
} entries;

/* The restore runs after the matmul has streamed the whole weight through the caches, so its entries miss (in DRAM
 * for a 0.55B model's 25 MB MLP weight), and stores that miss leave the store buffer one at a time, in order: it asks
 * for the entries of the row this many rows ahead while writing the current one (restore 0.6x the time at k = 4 to
 * 20 on 1536 x 4096, 0.7-0.9x on SmolLM2's shapes; docs/performance-history.md). The patch before the matmul
 * needs no such help (its loads run ahead on their own), and neither do rows of one entry each (a constant stride,
 * which the hardware prefetcher follows). */
#define RESTORE_PREFETCH_ROWS 4

/* The address of row i's first entry, for weights at `w` with a row stride of `s0` bytes. */
static inline char *entry_row(char *w, const void *rows, int rdt, int64_t i, int64_t s0) {
    return w + (rows ? index_at(rows, rdt, i) : i) * s0;
}

/* `v` rounded to `dtype` as torch's .to(dtype) rounds it, read back as float32. */
static inline float in_precision(float v, int dtype) {
    if (dtype == F32) return v;
    return dtype == BF16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
}

/* Rows [begin, end) of a patch (`c->delta` set) or a restore, for weights of element type `wdt`: a constant at each
 * call in visit_entries, so that every type gets a loop of its own (testing the type per entry made the float32 patch
 * and restore of a cold 4096 x 1536 weight at k = 20 1.6x slower). A row's entries are patched first to last and
 * restored last to first: a column repeated within a row gets both deltas, and its first saved value (the original)
 * is the one written back last. A patched entry is torch's `w + delta.to(w.dtype)` (the delta rounded to the
 * weight's type, the sum rounded once), as the in-place path's torch ops compute it for the weights these kernels do
 * not take; the saved entries are the weight's own bits, written back unchanged. Fields are read into locals once:
 * the byte copies below may alias anything, `c` included. */
static inline __attribute__((always_inline)) void visit_rows(const entries *c, int64_t begin, int64_t end, int wdt) {
    const int64_t size = wdt == F32 ? 4 : 2, k = c->k, s0 = c->s0 * size, s1 = c->s1 * size;
    const void *cols = c->cols, *rows = c->rows, *delta = c->delta;
    const int cdt = c->cdt, rdt = c->rdt, ddt = c->ddt;
    char *w = c->w, *saved = c->saved;
    for (int64_t i = begin; i < end; i++) {
        char *row = entry_row(w, rows, rdt, i, s0);
        if (delta) {
            for (int64_t e = i * k; e < (i + 1) * k; e++) {
                char *entry = row + index_at(cols, cdt, e) * s1;
                memcpy(saved + e * size, entry, size);
                store_elem(entry, 0, wdt, load_elem(entry, 0, wdt) + in_precision(load_elem(delta, e, ddt), wdt));
            }
        } else {
            if (k > 1 && i + RESTORE_PREFETCH_ROWS < end) {
                int64_t ahead = i + RESTORE_PREFETCH_ROWS;
                const char *next = entry_row(w, rows, rdt, ahead, s0);
                for (int64_t e = ahead * k; e < (ahead + 1) * k; e++)
                    __builtin_prefetch(next + index_at(cols, cdt, e) * s1, 1);
            }
            for (int64_t e = (i + 1) * k - 1; e >= i * k; e--)
                memcpy(row + index_at(cols, cdt, e) * s1, saved + e * size, size);
        }
    }
}

static void visit_entries(void *arg, int64_t begin, int64_t end, int worker) {
    (void)worker;
    const entries *c = arg;
    if (c->wdt == F32)
        visit_rows(c, begin, end, F32);
    else if (c->wdt == BF16)
        visit_rows(c, begin, end, BF16);
    else
        visit_rows(c, begin, end, F16);
}

static int entries_in_range(const void *cols, int cdt, const void *rows, int rdt, int64_t d_in, int64_t d_out,
                            int64_t n, int64_t k) {
    if (n < 0 || k < 0 || (rows == NULL && n != d_out)) return NA_BAD_ARGUMENT;
    int bad = 0;
    for (int64_t e = 0; e < n * k; e++) {
        int64_t c = index_at(cols, cdt, e);
        bad |= (c < 0) | (c >= d_in);
    }
    if (bad) return NA_BAD_COLUMN;
    for (int64_t i = 0; rows && i < n; i++) {
        int64_t r = index_at(rows, rdt, i);
        bad |= (r < 0) | (r >= d_out);
    }
    return bad ? NA_BAD_ROW : NA_OK;
}

/* Work units (worker_count) per entry: a cold entry is a cache miss, worth about a thousand multiply-adds, so the
 * rows are split from 256 entries on. Patch and restore of SmolLM2's 210 cold layers at 2 threads: k=1 8.6 -> 6.8-8.2
 * ms, k=20 26-29 -> 20-22 ms, against 64 units per entry (which left layers below 4096 entries on one thread). */
#define ENTRY_WORK 1024
static void visit_all(entries *c, int64_t n, int workers) {
    parallel_for(worker_count(workers, n, n * c->k * ENTRY_WORK), n, visit_entries, c);
}

int na_patch_entries(void *w, int64_t ws0, int64_t ws1, int wdt, const void *cols, int cdt, const void *rows,
                     int rdt, const void *delta, int ddt, patch_state *state, int64_t d_in, int64_t d_out, int64_t n,
                     int64_t k, int workers) {
    int status = entries_in_range(cols, cdt, rows, rdt, d_in, d_out, n, k);
    if (status) return status;
    if (state->applied) return NA_PATCHED;
    void *saved = aligned_buffer(n * k); /* room for float32 entries, and so for any element type */
    if (!saved) return NA_NO_MEMORY;
    entries c = {w, ws0, ws1, k, wdt, cols, rows, cdt, rdt, delta, ddt, saved};
    state->saved = saved;
    state->applied = 1;
    visit_all(&c, n, workers);
    return NA_OK;
}

int na_restore_entries(void *w, int64_t ws0, int64_t ws1, int wdt, const void *cols, int cdt, const void *rows,
                       int rdt, patch_state *state, int64_t n, int64_t k, int workers) {
    if (!state->applied) return NA_OK;
    entries c = {w, ws0, ws1, k, wdt, cols, rows, cdt, rdt, NULL, F32, state->saved};
    visit_all(&c, n, workers);
    free(state->saved);
    state->saved = NULL;
    state->applied = 0;
    return NA_OK;
}
