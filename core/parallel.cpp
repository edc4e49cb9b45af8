#include "core/parallel.h"

#include <omp.h>

#include "core/error.h"

namespace mn {

int get_num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  MN_CHECK(n >= 1, ValueError, "set_num_threads: expected a thread count >= 1, got ", n);
  omp_set_num_threads(n);
}

}  // namespace mn
