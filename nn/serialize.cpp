#include "nn/serialize.h"

namespace mn::nn {

void save(const Module& module, const std::string& path, const safetensors::StringMap& metadata) {
  safetensors::StringMap meta = metadata;
  meta.emplace("format", "pt");  // what torch's save_file writes; kept when the caller gave one
  safetensors::save(path, module.state_dict(), meta);
}

Module::LoadResult load(Module& module, const std::string& path, bool strict) {
  const safetensors::File file = safetensors::load(path);
  try {
    return module.load_state_dict(file.state_dict(), strict);
  } catch (const ValueError& e) {
    throw ValueError(str(path, ": ", e.what()));
  }
}

}  // namespace mn::nn
