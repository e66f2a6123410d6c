/* CPU loops (see utils/cpu_kernels.py): the head's optimizer row updates, one pass over each row, and its fused
   margin-softmax's passes over the (B, C) cosines; the backbones' PReLU backward, one pass over its input, and
   narrow convolutions, forward and backward.

   torch runs these updates as several whole-tensor operations, each reading and writing every row again;
   here each row of weight, state and gradient is read once and written once. The arithmetic is torch's,
   operation for operation and in the same order (torch's CPU kernels compute `a + alpha * b` as one fused
   multiply-add and everything else with one rounding per operation), so the results are the same bits.
   Built with -ffp-contract=off: the fused multiply-adds are exactly the explicit fmaf calls. */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <xmmintrin.h>
/* Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) for this thread until pfc_ftz_leave: a result or an
   operand below FLT_MIN (~1.2e-38) counts as 0. x86 CPUs compute with subnormal numbers in microcode, tens of
   times slower on some (2x on an AMD Zen 4); the caller's setting is put back before the loop returns. */
static inline unsigned pfc_ftz_enter(void) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);
  return csr;
}
static inline void pfc_ftz_leave(unsigned csr) { _mm_setcsr(csr); }
#else
static inline unsigned pfc_ftz_enter(void) { return 0u; }
static inline void pfc_ftz_leave(unsigned csr) { (void)csr; }
#endif

/* The functions that take or return GCC vectors are always inlined: no call passes them, whatever the ABI. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* The most an entry point may run: 2 the AVX-512 version, 1 the AVX2 one, 0 the baseline (pfc_limit_isa). */
static int pfc_isa_limit = 2;

#if defined(__x86_64__) && defined(__GNUC__)
/* The version the entry points run: the highest the CPU has, at most pfc_isa_limit. */
int64_t pfc_isa(void) {
  if (pfc_isa_limit >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return 2;
  if (pfc_isa_limit >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}
/* Every exported loop is one body built three times: for AVX-512 (F, BW and VL), for AVX2 with FMA, and for the
   baseline x86-64 (or the only build elsewhere); the entry point runs the version pfc_isa names. VL lets the
   8-float vectors below use all 32 vector registers (without it the margin-softmax's spilled to the stack and
   ran at half the speed of its AVX2 version). Explicit
   target attributes, not GCC's target_clones: those resolve `arch=` clones by CPU model (an AMD Zen 3 got the
   baseline) and make "avx2,fma" two clones, the AVX2 one without FMA (each fmaf a library call). Every version
   gives the same bits: the loops fix their order of summation, not the vector width. Each body returns 0 (or
   its own error code). */
#define PFC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define PFC_AVX2 __attribute__((target("avx2,fma")))
#define PFC_VERSIONS(name, params, args)                                               \
  PFC_AVX512 static int name##_avx512 params { return name##_body args; }              \
  PFC_AVX2 static int name##_avx2 params { return name##_body args; }                  \
  int name params {                                                                    \
    const int64_t isa = pfc_isa();                                                     \
    if (isa == 2) return name##_avx512 args;                                           \
    if (isa == 1) return name##_avx2 args;                                             \
    return name##_body args;                                                           \
  }
#else
int64_t pfc_isa(void) { return 0; }
#define PFC_VERSIONS(name, params, args) \
  int name params { return name##_body args; }
#endif

/* Caps the version the entry points run at `level` (tests compare the versions; PFC_CPU_KERNELS_ISA sets it
   once loaded) and returns the one they run now. Not for use while a loop runs. */
int64_t pfc_limit_isa(int64_t level) {
  pfc_isa_limit = (int)level;
  return pfc_isa();
}

/* PFC_LOOP(name, (parameters), (their names)) { body }: the exported loop `name` and its versions. */
#define PFC_LOOP(name, params, args)                                  \
  static inline __attribute__((always_inline)) int name##_body params; \
  PFC_VERSIONS(name, params, args)                                    \
  static inline __attribute__((always_inline)) int name##_body params

int64_t pfc_kernels_abi(void) { return 11; }

/* SGD with momentum and weight decay (torch.optim.SGD, dampening 0, no Nesterov) on rows [begin, end) of an
   n-row update of d values (the caller splits the rows between threads; rows are unique, so threads never
   write the same memory): row i of `grad` belongs to row rows[i] of `weight` and `momentum` (row i itself
   when rows is NULL):
     step = grad + weight_decay * weight;  momentum = momentum * mu + step;  weight -= lr * momentum  */
PFC_LOOP(pfc_sgd_rows,
         (float *weight, float *momentum, const float *grad, const int64_t *rows, int64_t begin, int64_t end,
          int64_t d, float lr, float mu, float weight_decay, int decay),
         (weight, momentum, grad, rows, begin, end, d, lr, mu, weight_decay, decay)) {
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
  return 0;
}

/* AdamW (decoupled decay) on rows [begin, end), as optimizers.RowSparseAdamW's torch operations; the per-row bias
   corrections come from the caller: step_size[i] = -lr / (1 - beta1^t), bias2_sqrt[i] = sqrt(1 - beta2^t).
     weight *= decay;  exp_avg = lerp(exp_avg, grad, 1 - beta1);  exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) g^2;
     weight += exp_avg * step_size / (sqrt(exp_avg_sq) / bias2_sqrt + eps)  */
PFC_LOOP(pfc_adamw_rows,
         (float *weight, float *exp_avg, float *exp_avg_sq, const float *grad, const int64_t *rows, int64_t begin,
          int64_t end, int64_t d, const float *step_size, const float *bias2_sqrt, float decay, float one_minus_beta1,
          float beta2, float one_minus_beta2, float eps),
         (weight, exp_avg, exp_avg_sq, grad, rows, begin, end, d, step_size, bias2_sqrt, decay, one_minus_beta1,
          beta2, one_minus_beta2, eps)) {
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
  return 0;
}

#define LANES 16
#define CHUNK 256 /* columns summed in float lanes before they join a double total */
/* 8 floats and a mask of 8 lanes: GCC vectors for loops whose plain form GCC would not vectorise everywhere.
   Two of them hold LANES lanes (wider vectors are split through memory on AVX2, and their comparisons run one
   lane at a time); a comparison of two gives all ones where it holds, else 0. */
typedef float pfc_octet_t __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t pfc_octet_mask_t __attribute__((vector_size(8 * sizeof(int32_t))));
/* a where take is all ones, else b: bit operations, no branch. */
static inline __attribute__((always_inline)) pfc_octet_t pfc_select(pfc_octet_mask_t take, pfc_octet_t a,
                                                                    pfc_octet_t b) {
  return (pfc_octet_t)(((pfc_octet_mask_t)a & take) | ((pfc_octet_mask_t)b & ~take));
}
/* 8 floats from / to p (any alignment). */
static inline __attribute__((always_inline)) pfc_octet_t pfc_load8(const float *p) {
  pfc_octet_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
static inline __attribute__((always_inline)) void pfc_store8(float *p, pfc_octet_t v) {
  __builtin_memcpy(p, &v, sizeof v);
}

/* How far ahead of its reads a pass over long rows (the margin-softmax's cosines, a shard's centres) prefetches:
   2048 floats (8 KB; past the row's end, the next row's start, or past the tensor's end, where a prefetch does
   nothing). Left to the hardware's prefetcher, the margin-softmax's passes waited on memory as long as they
   computed: on an Intel Xeon (2026-12-02, 256 rows), the backward at 50k columns took 27 ms with its cosines in
   memory and 7.3 ms with them ahead in cache, the forward at 500k columns 209 ms and 112 ms; the same bits. The
   address is formed as an integer: a pointer past the end of its array would be undefined behaviour in C, a
   prefetch of any address is not (it never faults). */
#define PFC_AHEAD 2048
#define PFC_PREFETCH_AHEAD(p, rw) \
  __builtin_prefetch((const void *)((uintptr_t)(p) + PFC_AHEAD * sizeof(float)), (rw), 3)

/* Streaming stores: rows written once and read again only after many more megabytes (the head's gathered rows,
   a gradient of a whole shard) are written without first reading their cache lines into the cache, as a plain
   store does: a third less memory traffic for a copy. SSE's 4-float store (every x86-64 version has it) where the
   row starts 16-byte aligned and holds a multiple of 4 values; plain stores elsewhere. A loop that streams ends
   with pfc_stream_fence, which orders those stores before the caller reads the rows (on another thread). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PFC_STREAMS 1
#else
#define PFC_STREAMS 0
#endif
static inline __attribute__((always_inline)) int pfc_streamable(const float *dst, int64_t r) {
  return PFC_STREAMS && ((uintptr_t)dst & 15) == 0 && r % 4 == 0;
}
static inline __attribute__((always_inline)) void pfc_stream_fence(void) {
#if PFC_STREAMS
  _mm_sfence();
#endif
}

/* The Euclidean norm of the d floats at x (d a multiple of 8) as torch.linalg.vector_norm computes it for the rows
   of an fp32 matrix: the squares added into 8 float lanes (lane = index mod 8, a product then a sum, no fused
   multiply-add), the lanes added in order, the square root. cpu_kernels.norms_like_torch checks that the torch in
   the process gives these bits before the head uses them. */
static inline __attribute__((always_inline)) float pfc_norm8(const float *restrict x, int64_t d) {
  pfc_octet_t acc = {0.0f};
  for (int64_t j = 0; j < d; j += 8) {
    const pfc_octet_t v = pfc_load8(x + j);
    acc = acc + v * v;
  }
  float total = acc[0];
  for (int k = 1; k < 8; ++k) total = total + acc[k];
  return sqrtf(total);
}

/* The head's sampled rows: rows idx[i] (i in [begin, end)) of `weight` (r values a row) copied to row i of `out`,
   the row after next prefetched (the rows are scattered over the shard), `out` written by streaming stores: in
   half to two thirds of torch's index_select's time. With `norms`, also the norms (pfc_norm8) of each row's r / d
   pieces of d values (a class's centres) into norms[i · r/d ...], read from the row just copied, still in cache:
   the pass over the gathered rows that torch's norm would make is saved. */
PFC_LOOP(pfc_gather_rows,
         (const float *weight, const int64_t *idx, int64_t r, float *out, float *norms, int64_t d, int64_t begin,
          int64_t end),
         (weight, idx, r, out, norms, d, begin, end)) {
  const int stream = pfc_streamable(out, r);
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict src = weight + idx[i] * r;
    float *restrict dst = out + i * r;
    if (i + 2 < end) __builtin_prefetch(weight + idx[i + 2] * r);
#if PFC_STREAMS
    if (stream) {
      for (int64_t j = 0; j < r; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
    } else
#endif
    {
      for (int64_t j = 0; j < r; ++j) dst[j] = src[j];
    }
    if (norms)
      for (int64_t k = 0; k < r / d; ++k) norms[i * (r / d) + k] = pfc_norm8(src + k * d, d);
  }
  if (stream) pfc_stream_fence();
  return 0;
}

/* Norms (pfc_norm8) of rows [begin, end) of x (d values a row, d a multiple of 8) into out: the centres' norms of a
   whole shard, each row PFC_AHEAD floats ahead prefetched first. */
PFC_LOOP(pfc_row_norms, (const float *x, int64_t d, float *out, int64_t begin, int64_t end),
         (x, d, out, begin, end)) {
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict row = x + i * d;
    for (int64_t j = 0; j < d; j += 16) PFC_PREFETCH_AHEAD(row + j, 0);
    out[i] = pfc_norm8(row, d);
  }
  return 0;
}

/* Rows [begin, end) of `src` (r values a row) times their coef[i] into the same rows of `out`, written by
   streaming stores: torch.mul(src, coef[:, None], out=out), one rounding a value. */
PFC_LOOP(pfc_scale_rows,
         (const float *src, const float *coef, int64_t r, float *out, int64_t begin, int64_t end),
         (src, coef, r, out, begin, end)) {
  const int stream = pfc_streamable(out, r);
  for (int64_t i = begin; i < end; ++i) {
    const float *restrict s = src + i * r;
    float *restrict d = out + i * r;
    const float k = coef[i];
#if PFC_STREAMS
    if (stream) {
      const __m128 k4 = _mm_set1_ps(k);
      for (int64_t j = 0; j < r; j += 4) _mm_stream_ps(d + j, _mm_mul_ps(_mm_loadu_ps(s + j), k4));
      continue;
    }
#endif
    for (int64_t j = 0; j < r; ++j) d[j] = s[j] * k;
  }
  if (stream) pfc_stream_fence();
  return 0;
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

/* pfc_exp on 8 floats, the same operations in the same order (the same bits): the clamps are vector selects,
   each fused multiply-add a loop over the lanes (one vector instruction where the CPU has FMA). Per value, the
   clamps' branches keep GCC from vectorising the products after them (a product may trap) without AVX-512's
   masks. */
static inline __attribute__((always_inline)) pfc_octet_t pfc_fma8(pfc_octet_t a, pfc_octet_t b, pfc_octet_t c) {
  pfc_octet_t r;
  for (int i = 0; i < 8; ++i) r[i] = fmaf(a[i], b[i], c[i]);
  return r;
}
static inline __attribute__((always_inline)) pfc_octet_t pfc_exp8(pfc_octet_t x) {
  const pfc_octet_t zero = {0.0f}, lo = zero - 87.0f, hi = zero + 88.0f, magic = zero + 12582912.0f;
  x = pfc_select(x < lo, lo, x);
  x = pfc_select(x > hi, hi, x);
  const pfc_octet_t n = x * 1.44269504088896341f + magic;
  const pfc_octet_t k = n - magic;
  pfc_octet_t r = pfc_fma8(k, zero - 0.693359375f, x);
  r = pfc_fma8(k, zero + 2.12194440e-4f, r);
  pfc_octet_t p = zero + 1.9875691500e-4f;
  p = pfc_fma8(p, r, zero + 1.3981999507e-3f);
  p = pfc_fma8(p, r, zero + 8.3334519073e-3f);
  p = pfc_fma8(p, r, zero + 4.1665795894e-2f);
  p = pfc_fma8(p, r, zero + 1.6666665459e-1f);
  p = pfc_fma8(p, r, zero + 5.0000001201e-1f);
  p = pfc_fma8(p, r * r, r + 1.0f);
  const pfc_octet_mask_t scale = ((pfc_octet_mask_t)n - 0x4B400000 + 127) << 23;
  return p * (pfc_octet_t)scale;
}
/* Whether the block of LANES columns starting at column j holds the target column t (a branch taken once a row:
   the other blocks skip the target's selects). */
static inline __attribute__((always_inline)) int pfc_target_in(int64_t j, int64_t t) {
  return __builtin_expect(t >= j && t < j + LANES, 0);
}
/* Lanes 8·half .. 8·half + 7 of a block of LANES columns starting at column j: all ones at the target column t. */
static inline __attribute__((always_inline)) pfc_octet_mask_t pfc_target_lanes(int64_t j, int64_t t, int half) {
  const pfc_octet_mask_t lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32_t at = t >= j && t < j + LANES ? (int32_t)(t - j) - 8 * half : -1;
  return lane == at;
}

/* Forward of the fused margin-softmax on rows [begin, end) of `cos` (B, c): each row is scaled in place by
   the centres' inverse norms (cos = products · inv_w: the cosines the backward reads), its logits are s·cos
   but target_logit[b] in column target[b] (no column when target[b] < 0), and row_max[b] / row_sum[b]
   receive their maximum and the sum of exp(logit − maximum). Sums and maxima run in LANES fixed lanes (lane =
   column mod LANES), so the result does not depend on the vector width; each CHUNK of columns' lanes is added
   to a double total, which keeps a sum over 10^5 columns as accurate as torch's. */
PFC_LOOP(pfc_softmax_forward,
         (float *cos, const float *inv_w, int64_t c, float s, const float *target_logit, const int64_t *target,
          float *row_max, float *row_sum, int64_t begin, int64_t end),
         (cos, inv_w, c, s, target_logit, target, row_max, row_sum, begin, end)) {
  for (int64_t b = begin; b < end; ++b) {
    float *restrict row = cos + b * c;
    const int64_t t = target[b];
    const float tl = target_logit[b];
    const pfc_octet_t zero = {0.0f};
    pfc_octet_t most0 = zero - INFINITY, most1 = most0, sum0, sum1; /* lanes 0-7 and 8-15 */
    int64_t j = 0;
    for (; j + LANES <= c; j += LANES) {
      PFC_PREFETCH_AHEAD(row + j, 1);
      const pfc_octet_t v0 = pfc_load8(row + j) * pfc_load8(inv_w + j);
      const pfc_octet_t v1 = pfc_load8(row + j + 8) * pfc_load8(inv_w + j + 8);
      pfc_store8(row + j, v0);
      pfc_store8(row + j + 8, v1);
      pfc_octet_t logit0 = s * v0, logit1 = s * v1;
      if (pfc_target_in(j, t)) {
        logit0 = pfc_select(pfc_target_lanes(j, t, 0), zero + tl, logit0);
        logit1 = pfc_select(pfc_target_lanes(j, t, 1), zero + tl, logit1);
      }
      most0 = pfc_select(logit0 > most0, logit0, most0);
      most1 = pfc_select(logit1 > most1, logit1, most1);
    }
    float lane[LANES];
    pfc_store8(lane, most0);
    pfc_store8(lane + 8, most1);
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
      sum0 = sum1 = zero;
      for (j = chunk; j + LANES <= stop; j += LANES) {
        PFC_PREFETCH_AHEAD(row + j, 0); /* the row again: in cache when it fits */
        pfc_octet_t logit0 = s * pfc_load8(row + j), logit1 = s * pfc_load8(row + j + 8);
        if (pfc_target_in(j, t)) {
          logit0 = pfc_select(pfc_target_lanes(j, t, 0), zero + tl, logit0);
          logit1 = pfc_select(pfc_target_lanes(j, t, 1), zero + tl, logit1);
        }
        sum0 = sum0 + pfc_exp8(logit0 - m);
        sum1 = sum1 + pfc_exp8(logit1 - m);
      }
      pfc_store8(lane, sum0);
      pfc_store8(lane + 8, sum1);
      for (; j < stop; ++j) lane[j % LANES] += pfc_exp((j == t ? tl : s * row[j]) - m);
      for (int k = 0; k < LANES; ++k) total += lane[k];
    }
    row_max[b] = m;
    row_sum[b] = (float)total;
  }
  return 0;
}

/* Backward of the fused margin-softmax on rows [begin, end) of `cos` (B, c), the scaled cosines: with
   p = exp(logit − row_max[b]) · coef[b] (the softmax, already divided by the global batch size), g = ∂L/∂cos is
   s·p off the target and slope[b]·(p − scale) on it; dot_w[j] += g·cos (column sums, over the rows in order),
   dot_e[b] = Σ_j g·cos (in lanes, as the forward), and the row is overwritten by G = g · inv_w. Runs with
   flush-to-zero (pfc_ftz_enter): a softmax value exp(logit − row_max) · coef below FLT_MIN, from logits ~87 or more
   below their row's largest, is 0 here, and every product with it costs what a normal one does. */
PFC_LOOP(pfc_softmax_backward,
         (float *cos, const float *inv_w, int64_t c, float s, float scale, const float *target_logit,
          const float *slope, const int64_t *target, const float *row_max, const float *coef, float *dot_w,
          float *dot_e, int64_t begin, int64_t end),
         (cos, inv_w, c, s, scale, target_logit, slope, target, row_max, coef, dot_w, dot_e, begin, end)) {
  const unsigned csr = pfc_ftz_enter();
  for (int64_t b = begin; b < end; ++b) {
    float *restrict row = cos + b * c;
    float *restrict dw = dot_w;
    const int64_t t = target[b];
    const float tl = target_logit[b], sl = slope[b], m = row_max[b], cf = coef[b];
    const pfc_octet_t zero = {0.0f};
    pfc_octet_t sum0, sum1; /* lanes 0-7 and 8-15 */
    float lane[LANES];
    double total = 0.0;
    for (int64_t chunk = 0; chunk < c; chunk += CHUNK) {
      const int64_t stop = chunk + CHUNK < c ? chunk + CHUNK : c;
      sum0 = sum1 = zero;
      int64_t j = chunk;
      for (; j + LANES <= stop; j += LANES) {
        PFC_PREFETCH_AHEAD(row + j, 1);
        const pfc_octet_t v0 = pfc_load8(row + j), v1 = pfc_load8(row + j + 8);
        const int hit = pfc_target_in(j, t);
        pfc_octet_t x0 = s * v0, x1 = s * v1;
        if (hit) {
          x0 = pfc_select(pfc_target_lanes(j, t, 0), zero + tl, x0);
          x1 = pfc_select(pfc_target_lanes(j, t, 1), zero + tl, x1);
        }
        const pfc_octet_t p0 = pfc_exp8(x0 - m) * cf, p1 = pfc_exp8(x1 - m) * cf;
        pfc_octet_t g0 = s * p0, g1 = s * p1;
        if (hit) {
          g0 = pfc_select(pfc_target_lanes(j, t, 0), sl * (p0 - scale), g0);
          g1 = pfc_select(pfc_target_lanes(j, t, 1), sl * (p1 - scale), g1);
        }
        const pfc_octet_t prod0 = v0 * g0, prod1 = v1 * g1;
        pfc_store8(dw + j, pfc_load8(dw + j) + prod0);
        pfc_store8(dw + j + 8, pfc_load8(dw + j + 8) + prod1);
        sum0 = sum0 + prod0;
        sum1 = sum1 + prod1;
        pfc_store8(row + j, g0 * pfc_load8(inv_w + j));
        pfc_store8(row + j + 8, g1 * pfc_load8(inv_w + j + 8));
      }
      pfc_store8(lane, sum0);
      pfc_store8(lane + 8, sum1);
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
  pfc_ftz_leave(csr);
  return 0;
}

/* One CHUNK (len <= CHUNK values) of a PReLU plane with slope a: out = x > 0 ? g : a·g (a NaN x takes a·g, as in
   torch), and the slope's gradient Σ x·g over the values with x not above 0, in LANES fixed lanes (lane = index
   mod LANES), the lanes added in order to the double `total`, which is returned. Written as a plain loop, the
   comparison x > 0 may trap, so without AVX-512's masked operations GCC keeps it a branch and runs one value
   at a time (10x slower on an AVX2 CPU); on 8-float vectors it is one vector comparison and the selects are
   bit masks. */
static inline __attribute__((always_inline)) double pfc_prelu_chunk(double total, const float *restrict x,
                                                                    const float *restrict g, float a,
                                                                    float *restrict out, int64_t len) {
  const pfc_octet_t zero = {0.0f};
  pfc_octet_t sum[2] = {zero, zero}; /* lanes 0-7 and 8-15 */
  int64_t j = 0;
  for (; j + LANES <= len; j += LANES)
    for (int half = 0; half < 2; ++half) {
      const pfc_octet_t xv = pfc_load8(x + j + 8 * half), gv = pfc_load8(g + j + 8 * half);
      const pfc_octet_mask_t positive = xv > zero;
      pfc_store8(out + j + 8 * half, pfc_select(positive, gv, a * gv));
      sum[half] = sum[half] + pfc_select(positive, zero, xv * gv);
    }
  float lane[LANES];
  __builtin_memcpy(lane, sum, sizeof lane);
  for (; j < len; ++j) {
    const float scaled = a * g[j], product = x[j] * g[j];
    out[j] = x[j] > 0.0f ? g[j] : scaled;
    lane[j % LANES] += x[j] > 0.0f ? 0.0f : product;
  }
  for (int k = 0; k < LANES; ++k) total += lane[k];
  return total;
}

/* PReLU's backward over images [begin, end) of an fp32 (N, c, hw) tensor, with torch's arithmetic: the input's
   gradient is g where x > 0, else w[ch]·g (one rounding; a NaN x takes the second branch, as in torch); the
   slope's gradient (pfc_prelu_chunk per CHUNK) is added to gw[ch] (double). torch's own kernel makes
   several passes and a reduction over a broadcast; this reads x and g once from memory (the sum rereads the
   chunk from L1) and writes gx once. */
PFC_LOOP(pfc_prelu_backward,
         (const float *x, const float *g, const float *w, int64_t c, int64_t hw, float *gx, double *gw, int64_t begin,
          int64_t end),
         (x, g, w, c, hw, gx, gw, begin, end)) {
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
        total = pfc_prelu_chunk(total, xp + chunk, gp + chunk, a, op + chunk, len);
      }
      gw[ch] += total;
    }
  }
  return 0;
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
   widening, the rounding and the sum are separate loops, so each vectorises (the narrowing store best with
   AVX-512BW, which every x86 CPU with bf16 arithmetic has). */
PFC_LOOP(pfc_prelu_backward_bf16,
         (const uint16_t *x, const uint16_t *g, const float *w, int64_t c, int64_t hw, uint16_t *gx, double *gw,
          int64_t begin, int64_t end),
         (x, g, w, c, hw, gx, gw, begin, end)) {
  float xf[CHUNK], gf[CHUNK], of[CHUNK];
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
        total = pfc_prelu_chunk(total, xf, gf, a, of, len);
        for (int64_t j = 0; j < len; ++j) op[chunk + j] = pfc_f32_to_bf16(of[j]);
      }
      gw[ch] += total;
    }
  }
  return 0;
}

/* Backward of a narrow 2-D convolution (backbones.conv.Conv2d on the CPU): square kernel k with zero padding
   pad, stride s, one group, no dilation, NCHW input x (n, ci, h, wd) and upstream gradient g (n, co, ho, wo),
   both fp32 or both bf16 (bf16 != 0); the forward's weight w (co, ci, k, k) as fp32 values. oneDNN's kernels
   block the channels in 8s or 16s, so a convolution with 2 or 3 channels at 112x112 spends its backward on
   padding (a 2 -> 2 3x3 convolution: ~22 ms for 32 images against ~4 ms forward here). This loop works on one
   image's planes at a time, vectorised along the rows.
   For images [begin, end): the input's gradient (when gx is not NULL; like x) and the weight's gradient, whose
   per-image sums are added to the doubles gw (co, ci, k, k). Each image is widened into zero-padded float
   planes (exact). Input gradient: every value is a float sum over (co, kh, kw) in that order, one fused
   multiply-add each, rounded once to bf16 for a bf16 x. Weight gradient: a sum over (oy, ox) in LANES fixed
   lanes (lane = ox mod LANES), the lanes added to a double per image: the same result for any vector width
   and thread count. Returns 0, or -1 when the planes cannot be allocated. */
static inline __attribute__((always_inline)) void pfc_conv_widen(float *restrict dst, const void *src, int bf16,
                                                                 int64_t len) {
  if (bf16) {
    const uint16_t *restrict s16 = (const uint16_t *)src;
    for (int64_t j = 0; j < len; ++j) dst[j] = pfc_bf16_to_f32(s16[j]);
  } else {
    const float *restrict s32 = (const float *)src;
    for (int64_t j = 0; j < len; ++j) dst[j] = s32[j];
  }
}

/* Σ_ox g[ox]·x[ox] over a row of wo values into LANES lanes (lane = ox mod LANES; a product and a sum, each
   rounded, per value), on 8-float vectors, so that every vector width computes the same lanes. */
static inline __attribute__((always_inline)) void pfc_conv_row_dot(float *restrict lane, const float *restrict g,
                                                                   const float *restrict x, int64_t wo) {
  pfc_octet_t sum[2]; /* lanes 0-7 and 8-15 */
  __builtin_memcpy(sum, lane, sizeof sum);
  int64_t j = 0;
  for (; j + LANES <= wo; j += LANES)
    for (int half = 0; half < 2; ++half)
      sum[half] = sum[half] + pfc_load8(g + j + 8 * half) * pfc_load8(x + j + 8 * half);
  __builtin_memcpy(lane, sum, sizeof sum);
  for (; j < wo; ++j) lane[j % LANES] = lane[j % LANES] + g[j] * x[j];
}

/* acc[ox] += v·g[ox] (one fused multiply-add) over a row of wo values. */
static inline __attribute__((always_inline)) void pfc_conv_row_axpy(float *restrict acc, const float *restrict g,
                                                                    float v, int64_t wo) {
  for (int64_t j = 0; j < wo; ++j) acc[j] = fmaf(v, g[j], acc[j]);
}

/* One image's ci channels of h x wd values (fp32 or bf16) into zero-padded float planes of hp rows of `row` values,
   split by phase (below); `line` holds wd floats. The padding stays as it is (0 from calloc). */
static inline __attribute__((always_inline)) void pfc_conv_load(float *restrict xp, float *restrict line,
                                                                const char *xi, int bf16, int64_t ci, int64_t h,
                                                                int64_t wd, int64_t pad, int S, int64_t wq,
                                                                int64_t row, int64_t plane) {
  const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
  for (int64_t c = 0; c < ci; ++c)
    for (int64_t y = 0; y < h; ++y) {
      float *dst = xp + c * plane + (y + pad) * row;
      pfc_conv_widen(line, xi + (size_t)((c * h + y) * wd) * elem, bf16, wd);
      for (int ph = 0; ph < S; ++ph) {  /* the columns j with (j + pad) mod S = ph, in order */
        const int64_t j0 = ((ph - pad) % S + S) % S;
        float *restrict d = dst + ph * wq + (j0 + pad) / S;
        for (int64_t m = 0; j0 + m * S < wd; ++m) d[m] = line[j0 + m * S];
      }
    }
}

/* n floats into out (fp32, or bf16 rounded to nearest even). */
static inline __attribute__((always_inline)) void pfc_conv_store(void *out, const float *restrict src, int bf16,
                                                                 int64_t n) {
  if (bf16) {
    uint16_t *restrict o16 = (uint16_t *)out;
    for (int64_t j = 0; j < n; ++j) o16[j] = pfc_f32_to_bf16(src[j]);
  } else {
    float *restrict o32 = (float *)out;
    for (int64_t j = 0; j < n; ++j) o32[j] = src[j];
  }
}

/* Rows are kept split by phase: column p of a padded row of wp values sits at phase p mod s, place p / s, each
   phase wq values long. Tap kw of output column ox reads padded column ox·s + kw: phase kw mod s, place
   ox + kw / s, so every row loop runs over consecutive values, whatever the stride. */
static inline __attribute__((always_inline)) int pfc_conv_backward_strided(
    const void *x, const void *g, const float *w, int bf16, int64_t ci, int64_t co, int64_t h, int64_t wd,
    int64_t ho, int64_t wo, int64_t k, int S, int64_t pad, void *gx, double *gw, int64_t begin, int64_t end) {
  const int64_t hp = h + 2 * pad, wp = wd + 2 * pad, wq = (wp + S - 1) / S, row = S * wq, plane = hp * row;
  const int64_t out_plane = ho * wo, taps = co * ci * k * k;
  float *xp = (float *)calloc((size_t)(ci * plane), sizeof(float));
  float *gf = (float *)malloc((size_t)(co * out_plane) * sizeof(float));
  float *lanes = (float *)malloc((size_t)(taps * LANES) * sizeof(float));
  float *acc = (float *)malloc((size_t)row * sizeof(float));
  float *line = (float *)malloc((size_t)wd * sizeof(float));
  if (!xp || !gf || !lanes || !acc || !line) {
    free(xp);
    free(gf);
    free(lanes);
    free(acc);
    free(line);
    return -1;
  }
  const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
  for (int64_t i = begin; i < end; ++i) {
    pfc_conv_load(xp, line, (const char *)x + (size_t)(i * ci * h * wd) * elem, bf16, ci, h, wd, pad, S, wq, row,
                  plane);
    pfc_conv_widen(gf, (const char *)g + (size_t)(i * co * out_plane) * elem, bf16, co * out_plane);
    /* Weight gradient, an output row at a time (its rows of g and x stay in L1 across the taps). */
    for (int64_t j = 0; j < taps * LANES; ++j) lanes[j] = 0.0f;
    for (int64_t oy = 0; oy < ho; ++oy)
      for (int64_t o = 0; o < co; ++o)
        for (int64_t c = 0; c < ci; ++c)
          for (int64_t kh = 0; kh < k; ++kh)
            for (int64_t kw = 0; kw < k; ++kw)
              pfc_conv_row_dot(lanes + (((o * ci + c) * k + kh) * k + kw) * LANES, gf + (o * ho + oy) * wo,
                               xp + c * plane + (oy * S + kh) * row + (kw % S) * wq + kw / S, wo);
    for (int64_t t = 0; t < taps; ++t) {
      double total = 0.0;
      for (int q = 0; q < LANES; ++q) total += lanes[t * LANES + q];
      gw[t] += total;
    }
    if (!gx) continue;
    /* Input gradient, a padded input row r at a time: the taps (o, kh, kw) in order, each adding the g row oy
       with oy·S + kh = r at the tap's phase and place. */
    for (int64_t c = 0; c < ci; ++c)
      for (int64_t y = 0; y < h; ++y) {
        const int64_t r = y + pad;
        for (int64_t j = 0; j < row; ++j) acc[j] = 0.0f;
        for (int64_t o = 0; o < co; ++o)
          for (int64_t kh = 0; kh < k; ++kh) {
            if (r < kh || (r - kh) % S != 0 || (r - kh) / S >= ho) continue;
            const float *grow = gf + (o * ho + (r - kh) / S) * wo;
            for (int64_t kw = 0; kw < k; ++kw)
              pfc_conv_row_axpy(acc + (kw % S) * wq + kw / S, grow, w[((o * ci + c) * k + kh) * k + kw], wo);
          }
        for (int ph = 0; ph < S; ++ph) {  /* back from the phases, as pfc_conv_load splits them */
          const int64_t j0 = ((ph - pad) % S + S) % S;
          const float *restrict a = acc + ph * wq + (j0 + pad) / S;
          for (int64_t m = 0; j0 + m * S < wd; ++m) line[j0 + m * S] = a[m];
        }
        pfc_conv_store((char *)gx + (size_t)(((i * ci + c) * h + y) * wd) * elem, line, bf16, wd);
      }
  }
  free(xp);
  free(gf);
  free(lanes);
  free(acc);
  free(line);
  return 0;
}

PFC_LOOP(pfc_conv_backward,
         (const void *x, const void *g, const float *w, int bf16, int64_t ci, int64_t co, int64_t h, int64_t wd,
          int64_t ho, int64_t wo, int64_t k, int64_t s, int64_t pad, void *gx, double *gw, int64_t begin, int64_t end),
         (x, g, w, bf16, ci, co, h, wd, ho, wo, k, s, pad, gx, gw, begin, end)) {
  if (s == 1) return pfc_conv_backward_strided(x, g, w, bf16, ci, co, h, wd, ho, wo, k, 1, pad, gx, gw, begin, end);
  if (s == 2) return pfc_conv_backward_strided(x, g, w, bf16, ci, co, h, wd, ho, wo, k, 2, pad, gx, gw, begin, end);
  return -2;
}

/* Forward of the same narrow convolutions: out (n, co, ho, wo), like x, for images [begin, end). Every output value
   is a float sum over the taps (c, kh, kw) in that order, one fused multiply-add each, rounded once (to bf16 for a
   bf16 x): torch's oneDNN kernels sum in another order, so the values agree to rounding. Returns 0, or -1 when the
   planes cannot be allocated. */
static inline __attribute__((always_inline)) int pfc_conv_forward_strided(
    const void *x, const float *w, int bf16, int64_t ci, int64_t co, int64_t h, int64_t wd, int64_t ho, int64_t wo,
    int64_t k, int S, int64_t pad, void *out, int64_t begin, int64_t end) {
  const int64_t hp = h + 2 * pad, wp = wd + 2 * pad, wq = (wp + S - 1) / S, row = S * wq, plane = hp * row;
  float *xp = (float *)calloc((size_t)(ci * plane), sizeof(float));
  float *line = (float *)malloc((size_t)wd * sizeof(float));
  float *acc = (float *)malloc((size_t)wo * sizeof(float));
  if (!xp || !line || !acc) {
    free(xp);
    free(line);
    free(acc);
    return -1;
  }
  const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
  for (int64_t i = begin; i < end; ++i) {
    pfc_conv_load(xp, line, (const char *)x + (size_t)(i * ci * h * wd) * elem, bf16, ci, h, wd, pad, S, wq, row,
                  plane);
    for (int64_t o = 0; o < co; ++o)
      for (int64_t oy = 0; oy < ho; ++oy) {
        for (int64_t j = 0; j < wo; ++j) acc[j] = 0.0f;
        for (int64_t c = 0; c < ci; ++c)
          for (int64_t kh = 0; kh < k; ++kh)
            for (int64_t kw = 0; kw < k; ++kw)
              pfc_conv_row_axpy(acc, xp + c * plane + (oy * S + kh) * row + (kw % S) * wq + kw / S,
                                w[((o * ci + c) * k + kh) * k + kw], wo);
        pfc_conv_store((char *)out + (size_t)(((i * co + o) * ho + oy) * wo) * elem, acc, bf16, wo);
      }
  }
  free(xp);
  free(line);
  free(acc);
  return 0;
}

PFC_LOOP(pfc_conv_forward,
         (const void *x, const float *w, int bf16, int64_t ci, int64_t co, int64_t h, int64_t wd, int64_t ho,
          int64_t wo, int64_t k, int64_t s, int64_t pad, void *out, int64_t begin, int64_t end),
         (x, w, bf16, ci, co, h, wd, ho, wo, k, s, pad, out, begin, end)) {
  if (s == 1) return pfc_conv_forward_strided(x, w, bf16, ci, co, h, wd, ho, wo, k, 1, pad, out, begin, end);
  if (s == 2) return pfc_conv_forward_strided(x, w, bf16, ci, co, h, wd, ho, wo, k, 2, pad, out, begin, end);
  return -2;
}
