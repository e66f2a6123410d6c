/* Row updates of the head's optimizers on the CPU, one pass over each row (see utils/cpu_kernels.py).

   torch runs these updates as several whole-tensor operations, each reading and writing every row again;
   here each row of weight, state and gradient is read once and written once. The arithmetic is torch's,
   operation for operation and in the same order (torch's CPU kernels compute `a + alpha * b` as one fused
   multiply-add and everything else with one rounding per operation), so the results are the same bits.
   Built with -ffp-contract=off: the fused multiply-adds are exactly the explicit fmaf calls. */
#include <math.h>
#include <stdint.h>
#include <stddef.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif

int64_t pfc_kernels_abi(void) { return 2; }

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
