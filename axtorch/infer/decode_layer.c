/* Transformer layers' decode step for one token of each of 1 to MAX_ROWS sequences (float32),
 * consecutive layers in one call: what axtorch/infer/native_layers.py runs for each run of layers
 * whose composition it recognises. The layer's modules would spend several times the time of its weight products on
 * small ops and module calls (docs/benchmarks.md); here the only reads that matter are the
 * weights' (once a step, whatever the rows) and the cache's.
 *
 * The math is the modules' (axtorch/layers): RMS norms, a stacked q/k/v product, optional per-head
 * query and key norms, the "rotate half" rotation by the caller's cos and signed sin tables, the
 * cache write at each row's slot, attention over the slots the caller's mask allows (scaled,
 * optionally soft-capped, softmax), the output product, optional post-norms (sandwich placement),
 * the stacked gate/up product, a gated activation and the down product, each sublayer added to x. */
#include <math.h>

#include "kernels.h"

enum activation { SILU, GELU, GELU_TANH, RELU };

/* A layer's sizes, constants and weights, filled once by the caller (native_layers.LayerSpec). */
typedef struct {
  long dim, heads, kv_heads, head_dim, hidden;
  float norm_eps, head_norm_eps, scale, softcap; /* softcap 0: none */
  int activation;
  const float *attention_norm, *attention_post_norm; /* post norms: NULL for pre-norm */
  const float *feed_forward_norm, *feed_forward_post_norm;
  const float *query_norm, *key_norm; /* NULL: none */
  const float *qkv_bias, *output_bias, *gate_up_bias, *down_bias; /* NULL: none */
  matrix_t qkv, output, gate_up, down;
} layer_t;

/* The scratch floats a step of `rows` sequences needs: the caller allocates them. */
AXTORCH_EXPORT long axtorch_decode_layer_scratch(const layer_t *l, long slots, long rows) {
  return rows * (2 * l->dim + (2 * l->heads + 2 * l->kv_heads) * l->head_dim + l->hidden + l->heads * slots);
}

static void rms_norm(const float *x, const float *weight, long n, float eps, float *out) {
  const float scale = 1.f / sqrtf(dot(x, x, n) / (float)n + eps);
  for (long i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

/* x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1], with the sign in the first half of sin. */
static void rotate(float *x, const float *cos, const float *sin, long n) {
  const long half = n / 2;
  for (long i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

static float activate(float x, int activation) {
  switch (activation) {
    case SILU: return x / (1.f + expf(-x));
    case GELU: return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
    case GELU_TANH: return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    default: return x > 0.f ? x : 0.f;
  }
}

/* The query and key norms and rotation, then the token's keys and values written to their slot. */
static void place_keys(const layer_t *l, float *q, float *k, const float *v, const float *cos, const float *sin,
                       float *keys, float *values, long slots, long slot) {
  const long d = l->head_dim;
  for (long h = 0; h < l->heads; ++h) {
    if (l->query_norm) rms_norm(q + h * d, l->query_norm, d, l->head_norm_eps, q + h * d);
    if (cos) rotate(q + h * d, cos, sin, d);
  }
  for (long g = 0; g < l->kv_heads; ++g) {
    if (l->key_norm) rms_norm(k + g * d, l->key_norm, d, l->head_norm_eps, k + g * d);
    if (cos) rotate(k + g * d, cos, sin, d);
    memcpy(keys + (g * slots + slot) * d, k + g * d, d * sizeof(float));
    memcpy(values + (g * slots + slot) * d, v + g * d, d * sizeof(float));
  }
}

/* Each row's query heads attend to their group's cached keys and values at the row's allowed slots
 * (rows x heads split over the threads of the enclosing region). Row r's queries are q [r], its
 * cache keys and values [r], its mask allowed [r]; `stride` floats separate two rows' q. */
static void attend(const layer_t *l, long rows, const float *q, long stride, const float *keys, const float *values,
                   const unsigned char *allowed, long slots, float *scores, float *context) {
  const long d = l->head_dim, heads = l->heads, group = heads / l->kv_heads, cache = l->kv_heads * slots * d;
#pragma omp for schedule(static)
  for (long rh = 0; rh < rows * heads; ++rh) {
    const long r = rh / heads, h = rh % heads;
    const float *query = q + r * stride + h * d;
    const float *k = keys + r * cache + h / group * slots * d, *v = values + r * cache + h / group * slots * d;
    const unsigned char *mask = allowed + r * slots;
    float *s = scores + rh * slots, *out = context + rh * d, top = -INFINITY, total = 0.f;
    for (long j = 0; j < slots; ++j) {
      if (!mask[j]) continue;
      float score = dot(query, k + j * d, d) * l->scale;
      if (l->softcap > 0.f) score = l->softcap * tanhf(score / l->softcap);
      s[j] = score;
      top = score > top ? score : top;
    }
    for (long j = 0; j < slots; ++j)
      if (mask[j]) total += s[j] = expf(s[j] - top);
    for (long i = 0; i < d; ++i) out[i] = 0.f;
    for (long j = 0; j < slots; ++j) {
      if (!mask[j]) continue;
      const float weight = s[j] / total, *value = v + j * d;
      for (long i = 0; i < d; ++i) out[i] += weight * value[i];
    }
  }
}

/* act(gate x) * (up x) for the stacked [gate; up] weight and `rows` rows of x: each thread reads the
 * gate's and the up projection's rows of its share of the hidden units once against every row of
 * x, so the activation needs no pass of its own. */
static void gated(const layer_t *l, long rows, const float *x, float *out) {
  const long hidden = l->hidden, dim = l->dim;
  const matrix_t *m = &l->gate_up;
  const float *gate = m->weight, *up = m->weight + hidden * dim, *bias = l->gate_up_bias;
  const dot_rows_t dot_rows = DOT_ROWS_OF[rows];
  const dot_two_rows_t dot_two_rows = DOT_TWO_ROWS_OF[rows];
#pragma omp for schedule(static)
  for (long i = 0; i < hidden; ++i) {
    float g[MAX_ROWS], u[MAX_ROWS];
    if (m->bits != 32) {
      coded_row_products(m, i, x, dim, rows, g);
      coded_row_products(m, hidden + i, x, dim, rows, u);
    } else if (dot_two_rows) {
      dot_two_rows(gate + i * dim, up + i * dim, x, dim, g, u);
    } else {
      dot_rows(gate + i * dim, x, dim, g);
      dot_rows(up + i * dim, x, dim, u);
    }
    for (long r = 0; r < rows; ++r) {
      if (bias) g[r] += bias[i], u[r] += bias[hidden + i];
      out[r * hidden + i] = activate(g[r], l->activation) * u[r];
    }
  }
}

static void add_sublayer(const layer_t *l, const float *post_norm, float *sub, float *x) {
  if (post_norm) rms_norm(sub, post_norm, l->dim, l->norm_eps, sub);
  for (long i = 0; i < l->dim; ++i) x[i] += sub[i];
}

/* One layer of a step (axtorch_decode_layers): the layer, the tables (cos, sin [rows, head_dim],
 * NULL for no rotation) and allowed slots (allowed [rows, slots], 0 or 1) the caller computed for
 * each row's position, its cache (keys and values [rows, kv_heads, slots, head_dim]) and the slot
 * (slot [rows]) each row's token's keys and values go to. */
typedef struct {
  const layer_t *layer;
  const float *cos, *sin;
  const unsigned char *allowed;
  float *keys, *values;
  long slots;
  const long *slot;
} layer_call_t;

/* Each row of x [rows, dim] <- the layer's output for it. Called by every thread of a parallel
 * region: the products and the heads are split, the small steps between them run on one thread,
 * and the last step's barrier leaves x whole for the next layer. */
static void layer_step(const layer_call_t *call, long rows, float *x, float *scratch) {
  const layer_t *l = call->layer;
  const long dim = l->dim, d = l->head_dim, heads = l->heads, kv = l->kv_heads, width = (heads + 2 * kv) * d;
  const long slots = call->slots;
  float *normed = scratch, *qkv = normed + rows * dim, *context = qkv + rows * width, *sub = context + rows * heads * d;
  float *hidden = sub + rows * dim, *scores = hidden + rows * l->hidden;
#pragma omp single
  for (long r = 0; r < rows; ++r) rms_norm(x + r * dim, l->attention_norm, dim, l->norm_eps, normed + r * dim);
  products(&l->qkv, normed, l->qkv_bias, qkv, width, dim, rows);
#pragma omp single
  for (long r = 0; r < rows; ++r) {
    float *q = qkv + r * width, *k = q + heads * d;
    const float *c = call->cos ? call->cos + r * d : NULL, *s = call->sin ? call->sin + r * d : NULL;
    const long cache = r * kv * slots * d;
    place_keys(l, q, k, k + kv * d, c, s, call->keys + cache, call->values + cache, slots, call->slot[r]);
  }
  attend(l, rows, qkv, width, call->keys, call->values, call->allowed, slots, scores, context);
  products(&l->output, context, l->output_bias, sub, dim, heads * d, rows);
#pragma omp single
  for (long r = 0; r < rows; ++r) {
    add_sublayer(l, l->attention_post_norm, sub + r * dim, x + r * dim);
    rms_norm(x + r * dim, l->feed_forward_norm, dim, l->norm_eps, normed + r * dim);
  }
  gated(l, rows, normed, hidden);
  products(&l->down, hidden, l->down_bias, sub, dim, l->hidden, rows);
#pragma omp single
  for (long r = 0; r < rows; ++r) add_sublayer(l, l->feed_forward_post_norm, sub + r * dim, x + r * dim);
}

/* `count` consecutive layers' step for one token of each of `rows` sequences, x [rows, dim]
 * updated in place, in one parallel region of `threads`: between two layers the caller would
 * otherwise spend, on a small model, a tenth of the step (Python's per-layer work, each time on
 * caches the weights just streamed through). `scratch` holds
 * axtorch_decode_layer_scratch floats for the largest of the layers. */
AXTORCH_EXPORT void axtorch_decode_layers(const layer_call_t *calls, long count, long rows, float *x,
                                          float *scratch, int threads) {
  (void)threads; /* without OpenMP */
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (long i = 0; i < count; ++i) layer_step(calls + i, rows, x, scratch);
}
