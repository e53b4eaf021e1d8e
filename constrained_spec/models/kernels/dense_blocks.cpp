// A dense linear of prompt rows, x [M, K] times weight blocks prepacked by oneDNN (each [n_b, K],
// side by side along the output columns), each block one matmul on one thread: torch's threads
// take whole blocks, so every output's bits depend on its block's shape alone, never on the
// thread count (see models/dense_blocks.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <omp.h>
#include <vector>

namespace {

at::Tensor linear_blocks(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef widths,
                         std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(x.dim() == 2, "linear_blocks: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(!blocks.empty() && blocks.size() == widths.size(), "linear_blocks: one width per block");
  std::vector<int64_t> first(widths.size() + 1, 0);
  for (size_t b = 0; b < widths.size(); ++b) first[b + 1] = first[b] + widths[b];
  // The result in `dtype` (None: x's): each block's output converted as it is put in place.
  auto out = at::empty({x.size(0), first.back()}, x.options().dtype(dtype.value_or(x.scalar_type())));
  const at::Tensor xc = x.contiguous();
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    // oneDNN splits a matmul by the thread count it reads (inside a parallel region too, where
    // it runs the parts one after the other): one, so a block is cut the same way on any thread
    // at any count. The count is this task's own (OpenMP), restored for an inline call.
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int64_t b = begin; b < end; ++b) {
      torch::jit::Stack stack{xc, blocks[b], c10::IValue(), std::string("none"),
                              c10::List<std::optional<at::Scalar>>(), c10::IValue()};
      op.callBoxed(&stack);
      out.narrow(1, first[b], widths[b]).copy_(stack[0].toTensor());
    }
    omp_set_num_threads(saved);
  });
  return out;
}

}  // namespace

// The blocks are oneDNN tensors: the call dispatches on their key.
TORCH_LIBRARY_IMPL(constrained_spec, MkldnnCPU, m) { m.impl("linear_blocks", &linear_blocks); }
