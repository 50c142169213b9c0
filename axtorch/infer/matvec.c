/* One batch-1 product, y = W x (+ b), for a row-major float32 W: what a decode step does with each
 * weight matrix. axtorch builds this file on the machine that runs it (axtorch/infer/native_kernels.py).
 *
 * Each row is one sequential read (``dot``, kernels.h); on an AMD EPYC (Zen 4) this read the
 * models' weights at 95-104% of a plain sum's rate, where BLAS's matrix-vector products reached
 * 35-60% (docs/benchmarks.md). Threads split the rows, in the OpenMP runtime torch itself runs
 * (the library links libgomp.so.1, which resolves to torch's already loaded copy), so they share
 * one pool of threads. */
#include "kernels.h"

AXTORCH_EXPORT void axtorch_matvec(const float *w, const float *x, const float *b, float *y, long rows, long cols, int threads) {
  (void)threads; /* without OpenMP */
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= 64)
  product(w, x, b, y, rows, cols);
}
