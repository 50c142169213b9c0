/* The products of a decode step, Y = X W^T (+ b), for a row-major float32 W and a few rows of X:
 * what a decode step of 1 to MAX_ROWS sequences does with each weight matrix. axtorch builds this
 * file on the machine that runs it (axtorch/infer/native_kernels.py).
 *
 * Each weight row is one sequential read (``dot``, kernels.h); on an AMD EPYC (Zen 4) this read the
 * models' weights at 95-104% of a plain sum's rate, where BLAS's matrix-vector products reached
 * 35-60% (docs/benchmarks.md). With several rows of X each weight row is still read once, against
 * all of them (``dot_rows_N``): a step of 8 sequences reads the weights as one of 1 does, where
 * torch's matrix product at 8 rows read them at about 40% of the rate. Threads split the weight
 * rows, in the OpenMP runtime torch itself runs (the library links libgomp.so.1, which resolves to
 * torch's already loaded copy), so they share one pool of threads. */
#include "kernels.h"

/* dot_rows_N(w, x, cols, y): y[i] = w . x[i] for N rows of x (row stride `cols`), reading w once.
 * N is a constant, so that the N accumulators stay in registers. */
#define DOT_ROWS(N)                                                                          \
  static void dot_rows_##N(const float *w, const float *x, long cols, float *y) {            \
    vector acc[N] = {{0}};                                                                   \
    long c = 0;                                                                              \
    for (; c + WIDTH <= cols; c += WIDTH) {                                                  \
      if (c % CACHE_LINE_FLOATS == 0) __builtin_prefetch(w + c + PREFETCH_AHEAD, 0, 0);      \
      const vector weights = load(w + c);                                                    \
      for (int i = 0; i < N; ++i) acc[i] += weights * load(x + i * cols + c);                \
    }                                                                                        \
    for (int i = 0; i < N; ++i) {                                                            \
      float sum = 0.f;                                                                       \
      for (int lane = 0; lane < WIDTH; ++lane) sum += acc[i][lane];                          \
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

typedef void (*dot_rows_t)(const float *, const float *, long, float *);
static const dot_rows_t DOT_ROWS_OF[MAX_ROWS + 1] = {
    0, 0, dot_rows_2, dot_rows_3, dot_rows_4, dot_rows_5, dot_rows_6, dot_rows_7, dot_rows_8,
};

AXTORCH_EXPORT void axtorch_matvec(const float *w, const float *x, const float *b, float *y, long rows, long cols,
                                   long count, int threads) {
  (void)threads; /* without OpenMP */
  if (count == 1) {
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= 64)
    product(w, x, b, y, rows, cols);
    return;
  }
  const dot_rows_t dot_rows = DOT_ROWS_OF[count];
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 64)
  for (long r = 0; r < rows; ++r) {
    float sums[MAX_ROWS];
    dot_rows(w + r * cols, x, cols, sums);
    for (long i = 0; i < count; ++i) y[i * rows + r] = b ? sums[i] + b[r] : sums[i];
  }
}
