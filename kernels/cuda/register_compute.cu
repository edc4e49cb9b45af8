// Registration of the CUDA compute kernels: each family fills its CUDA slots of the op table.
#include "kernels/kernels.h"

namespace mn::kernels {

void register_cuda_elementwise();  // kernels/cuda/elementwise.cu: unary, binary, where
void register_cuda_reduce();       // kernels/cuda/reduce.cu: reduce, arg_reduce, var
void register_cuda_index();        // kernels/cuda/index.cu: index_select, index_add
void register_cuda_softmax();      // kernels/cuda/softmax.cu: softmax, softmax_backward, cross_entropy_*
void register_cuda_conv();         // kernels/cuda/conv.cu: conv2d_*
void register_cuda_pool();         // kernels/cuda/pool.cu: max/avg pool2d
void register_cuda_batch_norm();   // kernels/cuda/batch_norm.cu
void register_cuda_norm();         // kernels/cuda/norm.cu: row_norm_* (layer norm, group norm)
void register_cuda_gather();         // kernels/cuda/gather.cu: gather, scatter_add
void register_cuda_scan();           // kernels/cuda/scan.cu: cumsum, topk
void register_cuda_adaptive_pool();  // kernels/cuda/adaptive_pool.cu: adaptive avg/max pool2d
void register_cuda_srht();           // kernels/cuda/srht.cu: srht_apply, srht_apply_transpose
void register_cuda_amp();            // kernels/cuda/amp.cu: non_finite_check_and_unscale, amp_update_scale
void register_cuda_mapped_group();   // kernels/cuda/mapped_group.cu: mapped_group_forward, _backward

void register_cuda_compute_kernels() {
  register_cuda_elementwise();
  register_cuda_reduce();
  register_cuda_index();
  register_cuda_softmax();
  register_cuda_conv();
  register_cuda_pool();
  register_cuda_batch_norm();
  register_cuda_norm();
  register_cuda_gather();
  register_cuda_scan();
  register_cuda_adaptive_pool();
  register_cuda_srht();
  register_cuda_amp();
  register_cuda_mapped_group();
}

}  // namespace mn::kernels
