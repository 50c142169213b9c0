/* One batch-1 product, y = W x (+ b), for a row-major float32 W: what a decode step does with each
 * weight matrix. axtorch compiles this file on the machine that runs it (axtorch/infer/native_kernels.py).
 *
 * Each row is one sequential read (``dot``, kernels.h); on an AMD EPYC (Zen 4) this read the
 * models' weights at about 90% of a plain sum's rate, where BLAS's matrix-vector products reached
 * 35-60% (docs/benchmarks.md). Threads split the rows, in the OpenMP runtime torch itself runs
 * (the library links libgomp.so.1, which resolves to torch's already loaded copy), so they share
 * one pool of threads. */
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static void rows_of(const float *w, const float *x, const float *b, float *y, long first, long last, long cols) {
  for (long r = first; r < last; ++r) {
    const float sum = dot(w + r * cols, x, cols);
    y[r] = b ? sum + b[r] : sum;
  }
}

void axtorch_matvec(const float *w, const float *x, const float *b, float *y, long rows, long cols, int threads) {
#ifdef _OPENMP
  if (threads > 1 && rows >= 64) {
#pragma omp parallel num_threads(threads)
    {
      long t = omp_get_thread_num(), n = omp_get_num_threads();
      rows_of(w, x, b, y, rows * t / n, rows * (t + 1) / n, cols);
    }
    return;
  }
#endif
  (void)threads;
  rows_of(w, x, b, y, 0, rows, cols);
}
