/* The products of a decode step, Y = X W^T (+ b), for a row-major float32 or coded W (``matrix_t``)
 * and a few rows of X:
 * what a decode step of 1 to MAX_ROWS sequences does with each weight matrix. axtorch builds this
 * file on the machine that runs it (axtorch/infer/native_kernels.py).
 *
 * Each weight row is one sequential read (``dot``, kernels.h); on an AMD EPYC (Zen 4) this read the
 * models' weights at 95-104% of a plain sum's rate, where BLAS's matrix-vector products reached
 * 35-60% (docs/benchmarks.md). With several rows of X each weight row is still read once, against
 * all of them (``products``, kernels.h): a step of 8 sequences reads the weights as one of 1 does,
 * where torch's matrix product at 8 rows read them at about 40% of the rate. Threads split the weight
 * rows, in the OpenMP runtime torch itself runs (the library links libgomp.so.1, which resolves to
 * torch's already loaded copy), so they share one pool of threads. */
#include "kernels.h"

AXTORCH_EXPORT void axtorch_matvec(const matrix_t *w, const float *x, const float *b, float *y, long rows,
                                   long cols, long count, int threads) {
  (void)threads; /* without OpenMP */
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= 64)
  products(w, x, b, y, rows, cols, count);
}

/* Whether this build reads block codes (``matrix_t``) at speed: with AVX-512 or AVX2 a pass over
 * 4-bit codes ran at 5-6 times the rate of the same weights in float32, over 8-bit ones 4 times
 * (one thread, the Intel Xeon host); a build for SSE2 alone widened them at half the float32 rate,
 * so there Python keeps the float32 weights. */
AXTORCH_EXPORT int axtorch_reads_codes(void) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}
