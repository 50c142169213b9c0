/* What axtorch's compiled decode kernels share (matvec.c, decode_layer.c): the dot product that
 * streams a weight row, and the products of a few rows of activations built on it. */
#ifndef AXTORCH_KERNELS_H
#define AXTORCH_KERNELS_H

#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The functions Python calls by name (ctypes): C names, also where torch's extension builder
 * compiles these files as C++. */
#ifdef __cplusplus
#define AXTORCH_EXPORT extern "C"
#else
#define AXTORCH_EXPORT
#endif

/* A vector of WIDTH floats, ACCUMULATORS of them in flight per weight row: one cache line a load
 * where the CPU has 512-bit registers (AVX-512), else half of one (AVX2, and two NEON registers
 * elsewhere); 64 floats a row per iteration either way. */
#ifdef __AVX512F__
#define WIDTH 16
#define ACCUMULATORS 4
#else
#define WIDTH 8
#define ACCUMULATORS 8
#endif
/* How far ahead of a read its cache lines are asked for, in floats (4 KiB): a weight matrix is one
 * sequential stream, and a prefetch past its end is harmless. On the AMD EPYC host it lifted a
 * pass over SmolLM2-135M's matrices from 87-89% of a plain sum's rate to 95-104%. */
#define PREFETCH_AHEAD 1024
/* Which caches a prefetch fills (__builtin_prefetch's locality): 0, non-temporal, was the AMD EPYC
 * host's best; on an Intel Xeon (Sapphire Rapids) non-temporal prefetches held a pass at 44% of
 * the probe, where into all levels (3) it reads at 66-80%, and without prefetches at 56%.
 * native_kernels.py passes 0 on AMD CPUs. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 3
#endif
#define CACHE_LINE_FLOATS 16
/* The most rows of x one product takes (axtorch_matvec): a decode step of up to 8 sequences. */
#define MAX_ROWS 8
typedef float vector __attribute__((vector_size(WIDTH * sizeof(float))));

static inline vector load(const float *p) {
  vector v;
  memcpy(&v, p, sizeof v); /* an unaligned load */
  return v;
}

/* The sum of v's lanes as a tree: the upper half added to the lower, down to four lanes, then
 * pairs, so log2(WIDTH) levels of adds (vector adds but the last two) rather than a chain of
 * WIDTH - 1 dependent ones. With several rows of x each weight row's products end in 2 x rows such
 * sums, which took as many cycles as the reads of a short weight row. */
typedef float eight __attribute__((vector_size(8 * sizeof(float))));
typedef float four __attribute__((vector_size(4 * sizeof(float))));
static inline float lane_sum(vector v) {
  eight e[WIDTH / 8];
  memcpy(e, &v, sizeof v);
#if WIDTH == 16
  e[0] += e[1];
#endif
  four f[2];
  memcpy(f, e, sizeof f);
  const four s = f[0] + f[1];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

/* a . b over n floats, a streamed from memory (a weight row), b at hand. ACCUMULATORS independent
 * vector accumulators, so the loads of a row stay in flight together. */
static inline float dot(const float *a, const float *b, long n) {
  const long step = WIDTH * ACCUMULATORS, whole = n / step * step;
  vector acc[ACCUMULATORS] = {{0}};
  long c = 0;
  for (; c < whole; c += step) {
    for (int line = 0; line < step; line += CACHE_LINE_FLOATS)
      __builtin_prefetch(a + c + PREFETCH_AHEAD + line, 0, PREFETCH_LOCALITY);
    for (int k = 0; k < ACCUMULATORS; ++k) acc[k] += load(a + c + k * WIDTH) * load(b + c + k * WIDTH);
  }
  for (; c + WIDTH <= n; c += WIDTH) acc[0] += load(a + c) * load(b + c);
  vector lanes = acc[0];
  for (int k = 1; k < ACCUMULATORS; ++k) lanes += acc[k];
  float sum = lane_sum(lanes);
  for (; c < n; ++c) sum += a[c] * b[c];
  return sum;
}

/* dot_rows_N(w, x, cols, y): y[i] = w . x[i] for N rows of x (row stride `cols`), reading w once.
 * N is a constant, so that the N accumulators stay in registers. */
#define DOT_ROWS(N)                                                                          \
  static inline void dot_rows_##N(const float *w, const float *x, long cols, float *y) {     \
    vector acc[N] = {{0}};                                                                   \
    long c = 0;                                                                              \
    for (; c + WIDTH <= cols; c += WIDTH) {                                                  \
      if (c % CACHE_LINE_FLOATS == 0) __builtin_prefetch(w + c + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY); \
      const vector weights = load(w + c);                                                    \
      for (int i = 0; i < N; ++i) acc[i] += weights * load(x + i * cols + c);                \
    }                                                                                        \
    for (int i = 0; i < N; ++i) {                                                            \
      float sum = lane_sum(acc[i]);                                                          \
      for (long k = c; k < cols; ++k) sum += w[k] * x[i * cols + k];                         \
      y[i] = sum;                                                                            \
    }                                                                                        \
  }
DOT_ROWS(2)
DOT_ROWS(3)
DOT_ROWS(4)
DOT_ROWS(5)
DOT_ROWS(6)
DOT_ROWS(7)
DOT_ROWS(8)

static inline void dot_rows_1(const float *w, const float *x, long cols, float *y) { y[0] = dot(w, x, cols); }

typedef void (*dot_rows_t)(const float *, const float *, long, float *);
/* The product of one weight row with 1 to MAX_ROWS rows of x, by the row count. */
static const dot_rows_t DOT_ROWS_OF[MAX_ROWS + 1] = {
    0, dot_rows_1, dot_rows_2, dot_rows_3, dot_rows_4, dot_rows_5, dot_rows_6, dot_rows_7, dot_rows_8,
};

/* dot_two_rows_N(wa, wb, x, cols, ya, yb): ya[i] = wa . x[i] and yb[i] = wb . x[i] for N rows of x,
 * two weight rows at once, so that each load of x serves two products: with several rows of x a
 * step is bound by loads of x, not of weights. 2N accumulators and three loads in flight must fit
 * the registers: up to 8 rows with AVX-512's 32, up to 6 with AVX2's 16. */
#define DOT_TWO_ROWS(N)                                                                                   \
  static inline void dot_two_rows_##N(const float *wa, const float *wb, const float *x, long cols, float *ya, \
                                      float *yb) {                                                        \
    vector acc_a[N] = {{0}}, acc_b[N] = {{0}};                                                            \
    long c = 0;                                                                                           \
    for (; c + WIDTH <= cols; c += WIDTH) {                                                               \
      if (c % CACHE_LINE_FLOATS == 0) {                                                                   \
        __builtin_prefetch(wa + c + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);                                \
        __builtin_prefetch(wb + c + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);                                \
      }                                                                                                   \
      const vector a = load(wa + c), b = load(wb + c);                                                    \
      for (int i = 0; i < N; ++i) {                                                                       \
        const vector xi = load(x + i * cols + c);                                                         \
        acc_a[i] += a * xi;                                                                               \
        acc_b[i] += b * xi;                                                                               \
      }                                                                                                   \
    }                                                                                                     \
    for (int i = 0; i < N; ++i) {                                                                         \
      float sa = lane_sum(acc_a[i]), sb = lane_sum(acc_b[i]);                                             \
      for (long k = c; k < cols; ++k) sa += wa[k] * x[i * cols + k], sb += wb[k] * x[i * cols + k];       \
      ya[i] = sa, yb[i] = sb;                                                                             \
    }                                                                                                     \
  }
DOT_TWO_ROWS(2)
DOT_TWO_ROWS(3)
DOT_TWO_ROWS(4)
DOT_TWO_ROWS(5)
DOT_TWO_ROWS(6)
#ifdef __AVX512F__
DOT_TWO_ROWS(7)
DOT_TWO_ROWS(8)
#define dot_two_rows_7_or_none dot_two_rows_7
#define dot_two_rows_8_or_none dot_two_rows_8
#else
#define dot_two_rows_7_or_none 0
#define dot_two_rows_8_or_none 0
#endif

/* dot_two_rows_1(wa, wb, x, cols, ya, yb): two weight rows against one row of x (a decode step of
 * one sequence), four accumulators each, so that two rows' streams are read at once. On the Intel
 * Xeon host a pass over SmolLM2-135M's matrices rose from 64% of the probe to 86-90% on one
 * thread, and from 73% to 82-101% on two, against ``dot``'s one row at a time (two accumulators a
 * row: 79-85% and 76-81%). */
static inline void dot_two_rows_1(const float *wa, const float *wb, const float *x, long cols, float *ya,
                                  float *yb) {
  enum { K = 4 };
  vector a[K] = {{0}}, b[K] = {{0}};
  long c = 0;
  for (; c + K * WIDTH <= cols; c += K * WIDTH) {
    for (int line = 0; line < K * WIDTH; line += CACHE_LINE_FLOATS) {
      __builtin_prefetch(wa + c + PREFETCH_AHEAD + line, 0, PREFETCH_LOCALITY);
      __builtin_prefetch(wb + c + PREFETCH_AHEAD + line, 0, PREFETCH_LOCALITY);
    }
    for (int k = 0; k < K; ++k) {
      const vector xk = load(x + c + k * WIDTH);
      a[k] += load(wa + c + k * WIDTH) * xk;
      b[k] += load(wb + c + k * WIDTH) * xk;
    }
  }
  for (; c + WIDTH <= cols; c += WIDTH) {
    const vector xc = load(x + c);
    a[0] += load(wa + c) * xc;
    b[0] += load(wb + c) * xc;
  }
  vector la = a[0], lb = b[0];
  for (int k = 1; k < K; ++k) la += a[k], lb += b[k];
  float sa = lane_sum(la), sb = lane_sum(lb);
  for (; c < cols; ++c) sa += wa[c] * x[c], sb += wb[c] * x[c];
  *ya = sa, *yb = sb;
}

typedef void (*dot_two_rows_t)(const float *, const float *, const float *, long, float *, float *);
/* The products of two weight rows with 1 to MAX_ROWS rows of x, by the row count (0: read one weight
 * row at a time, where the registers would not hold two). */
static const dot_two_rows_t DOT_TWO_ROWS_OF[MAX_ROWS + 1] = {
    0, dot_two_rows_1, dot_two_rows_2, dot_two_rows_3, dot_two_rows_4, dot_two_rows_5, dot_two_rows_6, dot_two_rows_7_or_none,
    dot_two_rows_8_or_none,
};

/* A weight matrix [rows, cols] as the products read it: float32 rows (bits 32), or blocks of
 * BLOCK consecutive weights of a row, each weight stored as a code and each block as a scale and
 * an offset, w = scale * code + offset, exactly the float32 weight (weight_codes.py finds them,
 * for weights that a 4- or 8-bit format was expanded from). Codes: 4 bits (0 to 15, byte j of a
 * block holds weight j in its low half and weight j + 16 in its high half) or 8 bits (-128 to 127). */
typedef struct {
  const float *weight;         /* [rows, cols], bits 32 */
  const unsigned char *codes;  /* [rows, cols * bits / 8] */
  const float *scales;         /* [rows, cols / BLOCK, 2]: each block's scale and offset */
  long bits;                   /* 32, 8 or 4 */
} matrix_t;

#define BLOCK 32
/* WIDTH 32-bit integers, as the codes widen to before they become floats. */
typedef int ints __attribute__((vector_size(WIDTH * sizeof(int))));

/* WIDTH bytes at p as 32-bit integers, zero- or sign-extended: one instruction with AVX-512 or
 * AVX2 (vpmovzxbd, vpmovsxbd). Elsewhere through 16-bit integers: GCC 12 widens a loaded vector of
 * bytes straight to 32 bits one byte at a time. */
static inline ints widen(const unsigned char *p, int is_signed) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
  return is_signed ? (ints)_mm512_cvtepi8_epi32(bytes) : (ints)_mm512_cvtepu8_epi32(bytes);
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
  return is_signed ? (ints)_mm256_cvtepi8_epi32(bytes) : (ints)_mm256_cvtepu8_epi32(bytes);
#else
  typedef short shorts __attribute__((vector_size(WIDTH * sizeof(short))));
  typedef signed char signed_bytes __attribute__((vector_size(WIDTH)));
  typedef unsigned char unsigned_bytes __attribute__((vector_size(WIDTH)));
  signed_bytes s;
  unsigned_bytes u;
  memcpy(&s, p, sizeof s);
  memcpy(&u, p, sizeof u);
  return is_signed ? __builtin_convertvector(__builtin_convertvector(s, shorts), ints)
                   : __builtin_convertvector(__builtin_convertvector(u, shorts), ints);
#endif
}

/* Block `b`'s 32 weights of a coded row, WIDTH at a time in order: the codes widened to floats,
 * times the scale, plus the offset. Whether the compiler fuses the two into one rounding does not
 * matter: weight_codes.py takes only blocks where both give the weight. */
static inline void block_weights(const unsigned char *codes, const float *scales, long bits, long b,
                                 vector w[BLOCK / WIDTH]) {
  const float scale = scales[2 * b], offset = scales[2 * b + 1];
  if (bits == 4) {
    for (int h = 0; h < BLOCK / 2 / WIDTH; ++h) { /* byte j: weight j low, weight j + 16 high */
      const ints pair = widen(codes + b * BLOCK / 2 + h * WIDTH, 0);
      w[h] = __builtin_convertvector(pair & 15, vector) * scale + offset;
      w[h + BLOCK / 2 / WIDTH] = __builtin_convertvector(pair >> 4, vector) * scale + offset;
    }
  } else {
    for (int k = 0; k < BLOCK / WIDTH; ++k)
      w[k] = __builtin_convertvector(widen(codes + b * BLOCK + k * WIDTH, 1), vector) * scale + offset;
  }
}

/* y[i] = w . x[i] for `count` rows of x (row stride `cols`), w one coded row: its codes and block
 * scales. Inlined where `bits` and `count` are constants (``dot_codes_BITS_N``), so that the 2 x
 * count accumulators stay in registers and the code width's branch folds away. */
static inline __attribute__((always_inline)) void dot_codes(const unsigned char *codes, const float *scales,
                                                            long bits, const float *x, long cols, long count,
                                                            float *y) {
  vector acc[MAX_ROWS][2] = {{{0}}};
  const long bytes = BLOCK * bits / 8;
  for (long b = 0; b < cols / BLOCK; ++b) {
    /* Each stream PREFETCH_AHEAD floats' bytes ahead, a line at a time. */
    if (b * bytes % 64 == 0) __builtin_prefetch(codes + b * bytes + PREFETCH_AHEAD * sizeof(float), 0, PREFETCH_LOCALITY);
    if (b % 8 == 0) __builtin_prefetch(scales + 2 * b + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);
    vector w[BLOCK / WIDTH];
    block_weights(codes, scales, bits, b, w);
    for (long i = 0; i < count; ++i)
      for (int k = 0; k < BLOCK / WIDTH; ++k) acc[i][k & 1] += w[k] * load(x + i * cols + b * BLOCK + k * WIDTH);
  }
  for (long i = 0; i < count; ++i) y[i] = lane_sum(acc[i][0] + acc[i][1]);
}

#define DOT_CODES(BITS, N)                                                                                  \
  static void dot_codes_##BITS##_##N(const unsigned char *codes, const float *scales, const float *x, long cols, \
                                     float *y) {                                                          \
    dot_codes(codes, scales, BITS, x, cols, N, y);                                                        \
  }
#define DOT_CODES_ROWS(BITS) \
  DOT_CODES(BITS, 1)         \
  DOT_CODES(BITS, 2)         \
  DOT_CODES(BITS, 3)         \
  DOT_CODES(BITS, 4)         \
  DOT_CODES(BITS, 5)         \
  DOT_CODES(BITS, 6)         \
  DOT_CODES(BITS, 7)         \
  DOT_CODES(BITS, 8)
DOT_CODES_ROWS(4)
DOT_CODES_ROWS(8)

typedef void (*dot_codes_t)(const unsigned char *, const float *, const float *, long, float *);
/* The product of one coded row with 1 to MAX_ROWS rows of x, by code width (4, 8) and row count. */
static const dot_codes_t DOT_CODES_OF[2][MAX_ROWS + 1] = {
    {0, dot_codes_4_1, dot_codes_4_2, dot_codes_4_3, dot_codes_4_4, dot_codes_4_5, dot_codes_4_6, dot_codes_4_7,
     dot_codes_4_8},
    {0, dot_codes_8_1, dot_codes_8_2, dot_codes_8_3, dot_codes_8_4, dot_codes_8_5, dot_codes_8_6, dot_codes_8_7,
     dot_codes_8_8},
};

/* ys[i] = row r of m . x[i] for `count` rows of x, m coded (bits 4 or 8). */
static inline void coded_row_products(const matrix_t *m, long r, const float *x, long cols, long count, float *ys) {
  DOT_CODES_OF[m->bits == 8][count](m->codes + r * cols * m->bits / 8, m->scales + r * cols / BLOCK * 2, x, cols, ys);
}

/* Y = X W^T (+ b) for `count` (1 to MAX_ROWS) rows of X [count, cols], Y [count, rows]: each weight
 * row read once against all rows of X, two float32 weight rows at a time where ``DOT_TWO_ROWS_OF``
 * has them. Inside an OpenMP parallel region the threads split the weight rows (an orphaned `omp
 * for`, which ends in a barrier); outside one, or built without OpenMP, the calling thread computes
 * them all. */
static inline void products(const matrix_t *m, const float *x, const float *b, float *y, long rows, long cols,
                            long count) {
  if (m->bits != 32) {
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      float sums[MAX_ROWS];
      coded_row_products(m, r, x, cols, count, sums);
      for (long i = 0; i < count; ++i) y[i * rows + r] = b ? sums[i] + b[r] : sums[i];
    }
    return;
  }
  const float *w = m->weight;
  const dot_rows_t dot_rows = DOT_ROWS_OF[count];
  const dot_two_rows_t dot_two_rows = DOT_TWO_ROWS_OF[count];
  const long step = dot_two_rows ? 2 : 1;
#pragma omp for schedule(static)
  for (long first = 0; first < (rows + step - 1) / step; ++first) {
    const long r = first * step;
    float sums[2][MAX_ROWS];
    const long done = r + 1 < rows && dot_two_rows ? 2 : 1;
    if (done == 2)
      dot_two_rows(w + r * cols, w + (r + 1) * cols, x, cols, sums[0], sums[1]);
    else
      dot_rows(w + r * cols, x, cols, sums[0]);
    for (long k = 0; k < done; ++k)
      for (long i = 0; i < count; ++i) y[i * rows + r + k] = b ? sums[k][i] + b[r + k] : sums[k][i];
  }
}

/* y = x W^T (+ b) for `count` (1 to MAX_ROWS) rows of x [count, cols], y [count, rows]: W's rows split
 * over `threads`. */
AXTORCH_EXPORT void axtorch_matvec(const matrix_t *w, const float *x, const float *b, float *y, long rows,
                                   long cols, long count, int threads);

#endif
