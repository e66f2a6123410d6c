/* CPU loops (see utils/cpu_kernels.py): the head's optimizer row updates, one pass over each row, and its fused
   margin-softmax's passes over the (B, C) cosines; the backbone's PReLU backward, one pass over its input.

   torch runs these updates as several whole-tensor operations, each reading and writing every row again;
   here each row of weight, state and gradient is read once and written once. The arithmetic is torch's,
   operation for operation and in the same order (torch's CPU kernels compute `a + alpha * b` as one fused
   multiply-add and everything else with one rounding per operation), so the results are the same bits.
   Built with -ffp-contract=off: the fused multiply-adds are exactly the explicit fmaf calls. */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif

int64_t pfc_kernels_abi(void) { return 6; }

/* SGD with momentum and weight decay (torch.optim.SGD, dampening 0, no Nesterov) on rows [begin, end) of an
   n-row update of d values (the caller splits the rows between threads; rows are unique, so threads never
   write the same memory): row i of `grad` belongs to row rows[i] of `weight` and `momentum` (row i itself
   when rows is NULL):
     step = grad + weight_decay * weight;  momentum = momentum * mu + step;  weight -= lr * momentum  */
CLONES void pfc_sgd_rows(float *weight, float *momentum, const float *grad, const int64_t *rows, int64_t begin,
                         int64_t end, int64_t d, float lr, float mu, float weight_decay, int decay) {
  const float neg_lr = -lr;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = rows ? rows[i] : i;
    float *restrict w = weight + r * d;
    float *restrict m = momentum + r * d;
    const float *restrict g = grad + i * d;
    if (rows && i + 2 < end) {
      __builtin_prefetch(weight + rows[i + 2] * d);
      __builtin_prefetch(momentum + rows[i + 2] * d);
    }
    for (int64_t j = 0; j < d; ++j) {
      const float step = decay ? fmaf(weight_decay, w[j], g[j]) : g[j];
      const float buf = m[j] * mu + step;
      m[j] = buf;
      w[j] = fmaf(neg_lr, buf, w[j]);
    }
  }
}

/* AdamW (decoupled decay) on rows [begin, end), as optimizers.RowSparseAdamW's torch operations; the per-row bias
   corrections come from the caller: step_size[i] = -lr / (1 - beta1^t), bias2_sqrt[i] = sqrt(1 - beta2^t).
     weight *= decay;  exp_avg = lerp(exp_avg, grad, 1 - beta1);  exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) g^2;
     weight += exp_avg * step_size / (sqrt(exp_avg_sq) / bias2_sqrt + eps)  */
CLONES void pfc_adamw_rows(float *weight, float *exp_avg, float *exp_avg_sq, const float *grad, const int64_t *rows,
                           int64_t begin, int64_t end, int64_t d, const float *step_size, const float *bias2_sqrt, float decay,
                           float one_minus_beta1, float beta2, float one_minus_beta2, float eps) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = rows ? rows[i] : i;
    float *restrict w = weight + r * d;
    float *restrict m = exp_avg + r * d;
    float *restrict v = exp_avg_sq + r * d;
    const float *restrict g = grad + i * d;
    const float c = step_size[i], b2 = bias2_sqrt[i];
    if (rows && i + 2 < end) {
      __builtin_prefetch(weight + rows[i + 2] * d);
      __builtin_prefetch(exp_avg + rows[i + 2] * d);
      __builtin_prefetch(exp_avg_sq + rows[i + 2] * d);
    }
    for (int64_t j = 0; j < d; ++j) {
      const float wj = w[j] * decay;
      const float mj = fmaf(one_minus_beta1, g[j] - m[j], m[j]);
      const float vj = fmaf(one_minus_beta2 * g[j], g[j], v[j] * beta2);
      m[j] = mj;
      v[j] = vj;
      w[j] = wj + (mj * c) / (sqrtf(vj) / b2 + eps);
    }
  }
}

/* The head's sampled rows: rows idx[i] (i in [begin, end)) of `weight` (r values a row) copied to row i of `out`,
   the row after next prefetched (the rows are scattered over the shard): about twice torch's index_select. */
CLONES void pfc_gather_rows(const float *weight, const int64_t *idx, int64_t r, float *out, int64_t begin,
                            int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict src = weight + idx[i] * r;
    float *restrict dst = out + i * r;
    if (i + 2 < end) __builtin_prefetch(weight + idx[i + 2] * r);
    for (int64_t j = 0; j < r; ++j) dst[j] = src[j];
  }
}

/* The head's class-sampling keys (partial_fc._sampling_keys) of the class ids [start, start + n) for one step's
   seed (in [0, 2^31)): key = hash(id, seed) · 2^32 + id, with the same 31-bit xor-shift / multiply hash in the
   same exact int64 arithmetic (every product stays below 2^58), so the keys are the torch operations' bits. One
   pass instead of about thirty whole-array operations over the shard's class ids. */
#define PFC_M31 ((int64_t)0x7FFFFFFF)
#define PFC_M30 ((int64_t)0x3FFFFFFF)
static inline int64_t pfc_mix31(int64_t x) {
  x = ((x ^ (x >> 16)) * 0x45D9F3B) & PFC_M31;
  x = ((x ^ (x >> 16)) * 0x45D9F3B) & PFC_M31;
  return x ^ (x >> 16);
}

static inline void pfc_keys(int64_t start, int64_t n, int64_t seed, int64_t *keys) {
  const int64_t salt = (seed * 0x2545F49) & PFC_M31;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = start + i;
    const int64_t first = pfc_mix31(((id & PFC_M31) ^ seed) & PFC_M31);
    keys[i] = ((pfc_mix31(first ^ salt) & PFC_M30) << 32) | id;
  }
}

static int pfc_descending(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x < y) - (x > y);
}

/* The sampled rows of partial_fc.PartialFC._sample in one call, for class ids [start, start + n) below 2^32:
   every row in positives[0 .. npos) (the shard's classes in the global batch; repeats allowed), then the
   negatives with the largest keys, k = min(n, max(k_base, distinct positives)) rows in all, written to `out`
   in increasing order; returns k, or -1 when memory for the n keys cannot be had. The same rows as the torch
   operations' (keys, positives lifted by 2^62, topk, sort): keys are distinct, so the k largest are one set.
   Instead of a top-k, the negatives' keys are counted in 2^16 buckets of their hash's top bits (a key's
   order is its hash's first), the bucket that holds the last negative to keep is sorted, and one pass in row
   order keeps every key at or above that one: the rows come out sorted. */
int64_t pfc_sample_rows(int64_t start, int64_t n, int64_t seed, const int64_t *positives, int64_t npos,
                        int64_t k_base, int64_t *out) {
  const int64_t lift = (int64_t)1 << 62;
  int64_t *keys = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
  if (!keys) return -1;
  pfc_keys(start, n, seed, keys);
  int64_t lifted = 0;
  for (int64_t p = 0; p < npos; ++p) {
    if (keys[positives[p]] < lift) {
      keys[positives[p]] += lift;
      ++lifted;
    }
  }
  int64_t k = k_base > lifted ? k_base : lifted;
  k = k < n ? k : n;
  const int64_t need = k - lifted; /* negatives to keep, at most n - lifted */
  int64_t cutoff = lift;           /* keep every key >= cutoff: the positives, and the negatives from it up */
  if (need > 0) {
    uint32_t *counts = calloc((size_t)1 << 16, sizeof(uint32_t));
    int64_t *bucket = NULL;
    if (!counts) {
      free(keys);
      return -1;
    }
    for (int64_t i = 0; i < n; ++i)
      if (keys[i] < lift) ++counts[keys[i] >> 46]; /* the hash's top 16 of 30 bits */
    int64_t above = 0, top = (1 << 16) - 1;
    while (above + counts[top] < need) above += counts[top--];
    bucket = malloc((size_t)counts[top] * sizeof(int64_t));
    if (!bucket) {
      free(counts);
      free(keys);
      return -1;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      if (keys[i] < lift && keys[i] >> 46 == top) bucket[m++] = keys[i];
    qsort(bucket, (size_t)m, sizeof(int64_t), pfc_descending);
    cutoff = bucket[need - above - 1];
    free(bucket);
    free(counts);
  }
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    if (keys[i] >= cutoff) out[m++] = i;
  free(keys);
  return m;
}

/* exp(x) in float, to ~1.3 units in the last place: 2^n · P(r) with x = n·ln2 + r, |r| <= ln2/2 (Cody-Waite
   split of ln2, degree-7 polynomial), n rounded by adding 1.5·2^23 (no float-to-int conversion, so a NaN stays
   a NaN). Branch-free, so the row loops below vectorise. Results below e^-87 are e^-87 (~1.6e-38), not 0. */
#define LANES 16
#define CHUNK 256 /* columns summed in float lanes before they join a double total */
static inline float pfc_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  union { float f; int32_t i; } n, scale;
  n.f = x * 1.44269504088896341f + 12582912.0f;
  const float k = n.f - 12582912.0f;
  float r = fmaf(k, -0.693359375f, x);
  r = fmaf(k, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r + 1.0f);
  scale.i = (n.i - 0x4B400000 + 127) << 23;
  return p * scale.f;
}

/* Forward of the fused margin-softmax on rows [begin, end) of `cos` (B, c): each row is scaled in place by
   the centres' inverse norms (cos = products · inv_w: the cosines the backward reads), its logits are s·cos
   but target_logit[b] in column target[b] (no column when target[b] < 0), and row_max[b] / row_sum[b]
   receive their maximum and the sum of exp(logit − maximum). Sums and maxima run in LANES fixed lanes (lane =
   column mod LANES), so the result does not depend on the vector width; each CHUNK of columns' lanes is added
   to a double total, which keeps a sum over 10^5 columns as accurate as torch's. */
CLONES void pfc_softmax_forward(float *cos, const float *inv_w, int64_t c, float s, const float *target_logit,
                                const int64_t *target, float *row_max, float *row_sum, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    float *restrict row = cos + b * c;
    const int64_t t = target[b];
    const float tl = target_logit[b];
    float lane[LANES];
    for (int k = 0; k < LANES; ++k) lane[k] = -INFINITY;
    int64_t j = 0;
    for (; j + LANES <= c; j += LANES) {
      for (int k = 0; k < LANES; ++k) {
        const float v = row[j + k] * inv_w[j + k];
        row[j + k] = v;
        const float logit = j + k == t ? tl : s * v;
        lane[k] = logit > lane[k] ? logit : lane[k];
      }
    }
    for (; j < c; ++j) {
      const float v = row[j] * inv_w[j];
      row[j] = v;
      const float logit = j == t ? tl : s * v;
      lane[j % LANES] = logit > lane[j % LANES] ? logit : lane[j % LANES];
    }
    float m = lane[0];
    for (int k = 1; k < LANES; ++k) m = lane[k] > m ? lane[k] : m;
    double total = 0.0;
    for (int64_t chunk = 0; chunk < c; chunk += CHUNK) {
      const int64_t stop = chunk + CHUNK < c ? chunk + CHUNK : c;
      for (int k = 0; k < LANES; ++k) lane[k] = 0.0f;
      for (j = chunk; j + LANES <= stop; j += LANES) {
        for (int k = 0; k < LANES; ++k) {
          const float logit = j + k == t ? tl : s * row[j + k];
          lane[k] += pfc_exp(logit - m);
        }
      }
      for (; j < stop; ++j) lane[j % LANES] += pfc_exp((j == t ? tl : s * row[j]) - m);
      for (int k = 0; k < LANES; ++k) total += lane[k];
    }
    row_max[b] = m;
    row_sum[b] = (float)total;
  }
}

/* Backward of the fused margin-softmax on rows [begin, end) of `cos` (B, c), the scaled cosines: with
   p = exp(logit − row_max[b]) · coef[b] (the softmax, already divided by the global batch size), g = ∂L/∂cos is
   s·p off the target and slope[b]·(p − scale) on it; dot_w[j] += g·cos (column sums, over the rows in order),
   dot_e[b] = Σ_j g·cos (in lanes, as the forward), and the row is overwritten by G = g · inv_w. */
CLONES void pfc_softmax_backward(float *cos, const float *inv_w, int64_t c, float s, float scale,
                                 const float *target_logit, const float *slope, const int64_t *target,
                                 const float *row_max, const float *coef, float *dot_w, float *dot_e, int64_t begin,
                                 int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    float *restrict row = cos + b * c;
    float *restrict dw = dot_w;
    const int64_t t = target[b];
    const float tl = target_logit[b], sl = slope[b], m = row_max[b], cf = coef[b];
    float lane[LANES];
    double total = 0.0;
    for (int64_t chunk = 0; chunk < c; chunk += CHUNK) {
      const int64_t stop = chunk + CHUNK < c ? chunk + CHUNK : c;
      for (int k = 0; k < LANES; ++k) lane[k] = 0.0f;
      int64_t j = chunk;
      for (; j + LANES <= stop; j += LANES) {
        for (int k = 0; k < LANES; ++k) {
          const float v = row[j + k];
          const int here = j + k == t;
          const float p = pfc_exp((here ? tl : s * v) - m) * cf;
          const float g = here ? sl * (p - scale) : s * p;
          const float prod = v * g;
          dw[j + k] += prod;
          lane[k] += prod;
          row[j + k] = g * inv_w[j + k];
        }
      }
      for (; j < stop; ++j) {
        const float v = row[j];
        const int here = j == t;
        const float p = pfc_exp((here ? tl : s * v) - m) * cf;
        const float g = here ? sl * (p - scale) : s * p;
        const float prod = v * g;
        dw[j] += prod;
        lane[j % LANES] += prod;
        row[j] = g * inv_w[j];
      }
      for (int k = 0; k < LANES; ++k) total += lane[k];
    }
    dot_e[b] = (float)total;
  }
}

/* PReLU's slope gradient over one CHUNK (len <= CHUNK values) of a plane: Σ x·g over the values with x not
   above 0, in LANES fixed lanes (lane = index mod LANES), the lanes added in order to the double `total`. */
static inline __attribute__((always_inline)) double pfc_prelu_slope_sum(double total, const float *restrict x,
                                                                         const float *restrict g, int64_t len) {
  float lane[LANES];
  for (int k = 0; k < LANES; ++k) lane[k] = 0.0f;
  int64_t j = 0;
  for (; j + LANES <= len; j += LANES)
    for (int k = 0; k < LANES; ++k) lane[k] += x[j + k] > 0.0f ? 0.0f : x[j + k] * g[j + k];
  for (; j < len; ++j) lane[j % LANES] += x[j] > 0.0f ? 0.0f : x[j] * g[j];
  for (int k = 0; k < LANES; ++k) total += lane[k];
  return total;
}

/* PReLU's backward over images [begin, end) of an fp32 (N, c, hw) tensor, with torch's arithmetic: the input's
   gradient is g where x > 0, else w[ch]·g (one rounding; a NaN x takes the second branch, as in torch); the
   slope's gradient (pfc_prelu_slope_sum per CHUNK) is added to gw[ch] (double). torch's own kernel makes
   several passes and a reduction over a broadcast; this reads x and g once from memory (the sum rereads the
   chunk from L1) and writes gx once. */
CLONES void pfc_prelu_backward(const float *x, const float *g, const float *w, int64_t c, int64_t hw, float *gx,
                               double *gw, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const int64_t offset = (i * c + ch) * hw;
      const float *restrict xp = x + offset;
      const float *restrict gp = g + offset;
      float *restrict op = gx + offset;
      const float a = w[ch];
      double total = 0.0;
      for (int64_t chunk = 0; chunk < hw; chunk += CHUNK) {
        const int64_t len = chunk + CHUNK < hw ? CHUNK : hw - chunk;
        for (int64_t j = chunk; j < chunk + len; ++j) op[j] = xp[j] > 0.0f ? gp[j] : a * gp[j];
        total = pfc_prelu_slope_sum(total, xp + chunk, gp + chunk, len);
      }
      gw[ch] += total;
    }
  }
}

/* bfloat16 <-> float as torch converts them: the upper 16 bits; rounding to nearest even, a NaN to 0x7FC0. */
static inline float pfc_bf16_to_f32(uint16_t v) {
  const uint32_t bits = (uint32_t)v << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
static inline uint16_t pfc_f32_to_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

/* pfc_prelu_backward for bf16 x, g and gx: each CHUNK is widened into float buffers (exact), then the same
   arithmetic and the same slope sum as the fp32 loop, gx rounded to nearest even as torch rounds it. The
   widening, the rounding and the sum are separate loops, so each vectorises; the narrowing store needs
   AVX-512BW on x86 (every x86 CPU with bf16 arithmetic has it), hence a version built for it, chosen at run
   time, beside the plain one (GCC's target_clones cannot name AVX-512BW). */
static inline __attribute__((always_inline)) void pfc_prelu_bf16_body(
    const uint16_t *x, const uint16_t *g, const float *w, int64_t c, int64_t hw, uint16_t *gx, double *gw,
    int64_t begin, int64_t end) {
  float xf[CHUNK], gf[CHUNK];
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const int64_t offset = (i * c + ch) * hw;
      const uint16_t *restrict xp = x + offset;
      const uint16_t *restrict gp = g + offset;
      uint16_t *restrict op = gx + offset;
      const float a = w[ch];
      double total = 0.0;
      for (int64_t chunk = 0; chunk < hw; chunk += CHUNK) {
        const int64_t len = chunk + CHUNK < hw ? CHUNK : hw - chunk;
        for (int64_t j = 0; j < len; ++j) {
          xf[j] = pfc_bf16_to_f32(xp[chunk + j]);
          gf[j] = pfc_bf16_to_f32(gp[chunk + j]);
        }
        for (int64_t j = 0; j < len; ++j) op[chunk + j] = pfc_f32_to_bf16(xf[j] > 0.0f ? gf[j] : a * gf[j]);
        total = pfc_prelu_slope_sum(total, xf, gf, len);
      }
      gw[ch] += total;
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bw"))) static void pfc_prelu_bf16_avx512bw(
    const uint16_t *x, const uint16_t *g, const float *w, int64_t c, int64_t hw, uint16_t *gx, double *gw,
    int64_t begin, int64_t end) {
  pfc_prelu_bf16_body(x, g, w, c, hw, gx, gw, begin, end);
}
#endif

void pfc_prelu_backward_bf16(const uint16_t *x, const uint16_t *g, const float *w, int64_t c, int64_t hw,
                             uint16_t *gx, double *gw, int64_t begin, int64_t end) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512bw")) {
    pfc_prelu_bf16_avx512bw(x, g, w, c, hw, gx, gw, begin, end);
    return;
  }
#endif
  pfc_prelu_bf16_body(x, g, w, c, hw, gx, gw, begin, end);
}
