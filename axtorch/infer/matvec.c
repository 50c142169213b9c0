/* One batch-1 product, y = W x (+ b), for a row-major float32 W: what a decode step does with each
 * weight matrix. axtorch compiles this file on the machine that runs it (axtorch/infer/native_matvec.py).
 *
 * Each row is one sequential read with eight independent accumulators, of eight floats each (a
 * width every x86-64 CPU since AVX2 has, and two NEON registers elsewhere), so the loads of a row
 * stay in flight together; on an AMD EPYC (Zen 4) this read the models' weights at about 90% of
 * a plain sum's rate, where BLAS's matrix-vector products reached 35-60% (docs/benchmarks.md).
 * Threads split the rows, in the OpenMP runtime torch itself runs (the library links libgomp.so.1,
 * which resolves to torch's already loaded copy), so they share one pool of threads. */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define WIDTH 8
#define ACCUMULATORS 8
typedef float vector __attribute__((vector_size(WIDTH * sizeof(float))));

static inline vector load(const float *p) {
  vector v;
  memcpy(&v, p, sizeof v); /* an unaligned load */
  return v;
}

static void rows_of(const float *w, const float *x, const float *b, float *y, long first, long last, long cols) {
  const long step = WIDTH * ACCUMULATORS, whole = cols / step * step;
  for (long r = first; r < last; ++r) {
    const float *row = w + r * cols;
    vector acc[ACCUMULATORS] = {{0}};
    long c = 0;
    for (; c < whole; c += step)
      for (int k = 0; k < ACCUMULATORS; ++k) acc[k] += load(row + c + k * WIDTH) * load(x + c + k * WIDTH);
    for (; c + WIDTH <= cols; c += WIDTH) acc[0] += load(row + c) * load(x + c);
    vector lanes = acc[0];
    for (int k = 1; k < ACCUMULATORS; ++k) lanes += acc[k];
    float sum = 0.f;
    for (int i = 0; i < WIDTH; ++i) sum += lanes[i];
    for (; c < cols; ++c) sum += row[c] * x[c];
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
