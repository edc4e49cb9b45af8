// Fills the CPU column of the op table; each family registers its own kernels.
#include "kernels/kernels.h"

namespace mn::kernels {

void register_cpu_elementwise();  // kernels/cpu/elementwise.cpp: unary, binary, where, fill, copy, random_fill
void register_cpu_reduce();       // kernels/cpu/reduce.cpp: reduce, arg_reduce, var
void register_cpu_index();        // kernels/cpu/index.cpp: index_select, index_add
void register_cpu_linalg();       // kernels/cpu/linalg.cpp: gemm
void register_cpu_softmax();      // kernels/cpu/softmax.cpp: softmax, softmax_backward, cross_entropy_*
void register_cpu_conv();         // kernels/cpu/conv.cpp: conv2d_*
void register_cpu_pool();         // kernels/cpu/pool.cpp: max/avg pool2d
void register_cpu_batch_norm();   // kernels/cpu/batch_norm.cpp
void register_cpu_optim();        // kernels/cpu/optim.cpp: adam_step, sgd_step, adam_amsgrad_step, rmsprop_step
void register_cpu_norm();         // kernels/cpu/norm.cpp: row_norm_* (layer norm, group norm)
void register_cpu_gather();         // kernels/cpu/gather.cpp: gather, scatter_add
void register_cpu_scan();           // kernels/cpu/scan.cpp: cumsum, topk
void register_cpu_adaptive_pool();  // kernels/cpu/adaptive_pool.cpp: adaptive avg/max pool2d
void register_cpu_srht();           // kernels/cpu/srht.cpp: srht_apply, srht_apply_transpose
void register_cpu_amp();            // kernels/cpu/amp.cpp: non_finite_check_and_unscale, amp_update_scale
void register_cpu_mapped_group();   // kernels/cpu/mapped_group.cpp: mapped_group_forward, _backward

void register_cpu_kernels() {
  register_cpu_elementwise();
  register_cpu_reduce();
  register_cpu_index();
  register_cpu_linalg();
  register_cpu_softmax();
  register_cpu_conv();
  register_cpu_pool();
  register_cpu_batch_norm();
  register_cpu_optim();
  register_cpu_norm();
  register_cpu_gather();
  register_cpu_scan();
  register_cpu_adaptive_pool();
  register_cpu_srht();
  register_cpu_amp();
  register_cpu_mapped_group();
}

}  // namespace mn::kernels
