#include "core/storage.h"

#include "core/capture.h"
#include "core/cuda.h"

namespace mn {

// Device memory belongs to the stream that is current when it is allocated (core/cuda.h).
Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  if (capture::recording()) pool_ = capture::pool_for(device);
  allocator_ = pool_ ? pool_.get() : &allocator_for(device);
  alloc_ = allocator_->allocate(nbytes, device.is_cpu() ? StreamId{0} : cuda::current_stream_id(device.index));
}

Storage::Storage(Borrowed, void* ptr, size_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), allocator_(nullptr) {
  alloc_.ptr = ptr;
}

Storage::~Storage() {
  if (allocator_ != nullptr) allocator_->free(alloc_);
}

}  // namespace mn
