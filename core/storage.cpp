#include "core/storage.h"

namespace mn {

Storage::Storage(size_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), allocator_(&allocator_for(device)) {
  alloc_ = allocator_->allocate(nbytes);
}

Storage::~Storage() { allocator_->free(alloc_); }

}  // namespace mn
