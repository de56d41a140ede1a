// The operator schemas of megatron_het's fused kernels, and the Python module that loads them.
//
// Each op family registers its implementations per device in its own folder (rms_norm/, rope/,
// cross_entropy/, swiglu/): the CPU one always, the CUDA one (HIP on a ROCm torch, through
// hipify) where the extension is built with a device toolchain. Python reaches them as
// torch.ops.megatron_het.<name>; megatron_het/kernels/ wraps them in autograd functions and
// checks their arguments first, so the TORCH_CHECKs in the implementations are a second line.
//
// The module has no Python functions of its own: importing megatron_het._C loads the library,
// whose static initialisers register the ops with torch's dispatcher. (No pybind11: it would
// double the build time for nothing.)

#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(megatron_het, m) {
  // RMSNorm over the last dimension of x[N, H], with an optional fused residual add.
  //   sum  = x + residual (rounded to x's dtype; an empty tensor when residual is None)
  //   rstd = 1 / sqrt(mean(sum^2) + eps)              float32 [N]
  //   out  = sum * rstd * weight                      x's dtype [N, H], rounded once
  m.def(
      "rms_norm_fwd(Tensor x, Tensor? residual, Tensor weight, float eps)"
      " -> (Tensor out, Tensor sum, Tensor rstd)");
  // Backward of rms_norm_fwd given the normed input (its `sum`, or x without a residual):
  //   grad_input  = (weight*g - n * mean(weight*g*n)) * rstd + grad_sum, with n = input * rstd
  //   grad_weight = sum over rows of g * n            float32 [H] (empty unless weight_grad)
  m.def(
      "rms_norm_bwd(Tensor grad_out, Tensor? grad_sum, Tensor input, Tensor weight,"
      " Tensor rstd, bool weight_grad) -> (Tensor grad_input, Tensor grad_weight)");
  // Rotary embedding (rotate-half) of q[B, S, G, R, D] and k[B, S, G2, R2, D] in one launch,
  // position of row s = offset + s, angles from float32 cos/sin tables [P, D/2];
  // inverse rotates by minus the angle (the backward). Outputs are contiguous.
  m.def(
      "rope_fwd(Tensor q, Tensor? k, Tensor cos, Tensor sin, int offset, bool inverse)"
      " -> (Tensor q_out, Tensor k_out)");
  // Softmax cross-entropy statistics of a (vocabulary-shard) logits chunk [N, V] whose columns
  // are token ids [vocab_start, vocab_start + V): row max, sum of exp(logit - max), and the
  // label's logit (0 where the label is not in this shard). All float32 [N].
  m.def(
      "cross_entropy_stats(Tensor logits, Tensor labels, int vocab_start)"
      " -> (Tensor max, Tensor sum_exp, Tensor target)");
  // In place: logits <- (exp(logits - lse) - onehot(label - vocab_start)) * scale, per row.
  m.def(
      "cross_entropy_grad_(Tensor(a!) logits, Tensor labels, int vocab_start, Tensor lse,"
      " Tensor? scale) -> ()");
  // Both in one call for a chunk holding the whole vocabulary row: returns the float32 loss
  // [N] = log(sum_exp) + max - target and writes the gradient in place as cross_entropy_grad_.
  m.def(
      "cross_entropy_fused_(Tensor(a!) logits, Tensor labels, int vocab_start, Tensor? scale)"
      " -> Tensor loss");
  // SwiGLU's gating product of gate and up, both [..., F] of one shape, dtype and device, each
  // read as rows [N, F] with stride 1 along F and one stride between rows (the halves of a
  // fused [N, 2F] projection qualify; other layouts must be made contiguous first). In float32,
  // with s = sigmoid(g) (no overflow for any |g|):
  //   out = silu(g) * u = g * s * u                  gate's dtype, contiguous, rounded once
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor out");
  // Backward of swiglu_fwd given grad [..., F] (same layout rule); silu is recomputed from gate:
  //   grad_up   = grad * g * s
  //   grad_gate = grad * u * s * (1 + g * (1 - s))   both gate's dtype, contiguous, rounded once
  // At g = +inf and -inf both take their limits (silu is +inf and -0 there, its slope 1 and
  // 0); a NaN in gives NaN out.
  m.def("swiglu_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
}

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kernels_module); }
