// libFuzzer target for mapping checkpoints, below the safetensors parser: each input is written to a
// file, read as a checkpoint, loaded into a real MappingModel and MappingTrainer of the setup it
// names (checkpoint_setup.h), and then trained for one step, so that whatever the load accepted
// (latents, scales, optimizer moments, scheduler and trainer state, loss coefficients) is used by
// the forward, the backward and the optimizer kernels. Every input must either be refused with an
// mn::Error or train; any other exception, crash or sanitizer report is a bug. Built and run by
// tests/fuzz/run_fuzz.sh checkpoint; seeds in tests/fuzz/corpus_checkpoint.
//
// Byte mutations alone rarely get past the safetensors container (its tensors must tile the data
// buffer exactly, so changing one shape means rewriting offsets and lengths), so most mutations are
// made on the parsed file instead and written back as a valid container: a tensor's shape, dtype,
// values or name, a tensor dropped, a metadata entry removed or its JSON text mutated. This reaches
// the checkpoint's own checks - e.g. a 0-d optimizer moment is one shape edit away from a seed.
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "nn/safetensors.h"
#include "tests/fuzz/checkpoint_setup.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace {

namespace st = mn::safetensors;
using Rng = std::minstd_rand;

size_t pick(Rng& rng, size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); }

// `values` repeated or cut to the new element count (zeros when there were none).
template <class T>
std::vector<T> resized(const std::vector<T>& values, int64_t numel) {
  std::vector<T> out(static_cast<size_t>(numel));
  for (size_t i = 0; i < out.size(); ++i) out[i] = values.empty() ? T{} : values[i % values.size()];
  return out;
}

mn::Tensor reshaped(const mn::Tensor& t, const std::vector<int64_t>& dims) {
  int64_t numel = 1;
  for (int64_t d : dims) numel *= d;
  const mn::Shape shape(dims);
  mn::Tensor out = t.dtype() == mn::DType::i64 ? mn::from_vector(resized(t.to_vector<int64_t>(), numel), shape)
                                                : mn::from_vector(resized(t.to_vector<float>(), numel), shape);
  return dims.empty() ? out.reshape({}) : out;  // from_vector reads an empty shape as [numel]
}

// A new shape for a tensor: 0-d, a dimension dropped, added or resized. Small, so the file stays small.
mn::Tensor mutate_shape(const mn::Tensor& t, Rng& rng) {
  std::vector<int64_t> dims(t.sizes().begin(), t.sizes().end());
  switch (pick(rng, 4)) {
    case 0: dims.clear(); break;
    case 1: if (!dims.empty()) dims.erase(dims.begin() + static_cast<std::ptrdiff_t>(pick(rng, dims.size()))); break;
    case 2: dims.insert(dims.begin() + static_cast<std::ptrdiff_t>(pick(rng, dims.size() + 1)), 1 + pick(rng, 3)); break;
    default:
      if (dims.empty()) dims.push_back(1);
      dims[pick(rng, dims.size())] = static_cast<int64_t>(pick(rng, 17));
  }
  int64_t numel = 1;
  for (int64_t d : dims) numel *= d;
  return numel <= 4096 ? reshaped(t, dims) : t;
}

mn::Tensor mutate_values(const mn::Tensor& t, Rng& rng) {
  if (t.numel() == 0) return t;
  const size_t at = pick(rng, static_cast<size_t>(t.numel()));
  if (t.dtype() == mn::DType::i64) {
    std::vector<int64_t> v = t.to_vector<int64_t>();
    const int64_t choices[] = {0, -1, 1, 2, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
    v[at] = choices[pick(rng, std::size(choices))];
    return mn::from_vector(v, t.sizes());
  }
  std::vector<float> v = t.to_vector<float>();
  const float choices[] = {0.0f, -1.0f, 1e30f, -1e-30f, std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  v[at] = choices[pick(rng, std::size(choices))];
  return mn::from_vector(v, t.sizes());
}

// One structural edit of a parsed checkpoint; false when the chosen edit does not apply. Shapes are
// edited most often: every tensor's shape must be checked against the model's.
bool mutate_structure(st::NamedTensors& tensors, st::StringMap& metadata, Rng& rng) {
  static constexpr size_t kinds[] = {0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 6};
  const size_t kind = kinds[pick(rng, std::size(kinds))];
  if (kind == 6 || tensors.empty()) {  // metadata: drop an entry, or mutate its JSON text as bytes
    if (metadata.empty()) return false;
    auto it = std::next(metadata.begin(), static_cast<std::ptrdiff_t>(pick(rng, metadata.size())));
    if (pick(rng, 4) == 0) {
      metadata.erase(it);
      return true;
    }
    std::string& text = it->second;
    const size_t max_size = text.size() * 2 + 16;
    std::vector<uint8_t> bytes(text.begin(), text.end());
    bytes.resize(max_size);
    bytes.resize(LLVMFuzzerMutate(bytes.data(), text.size(), max_size));
    text.assign(bytes.begin(), bytes.end());
    return true;
  }
  const size_t i = pick(rng, tensors.size());
  auto& [name, tensor] = tensors[i];
  switch (kind) {
    case 0: tensor = mutate_shape(tensor, rng); return true;
    case 1: tensor = mutate_values(tensor, rng); return true;
    case 2:  // the other engine dtype, same values
      tensor = tensor.dtype() == mn::DType::i64 ? tensor.to(mn::DType::f32) : tensor.to(mn::DType::i64);
      return true;
    case 3:  // another tensor's name (a duplicate is refused by serialize: the edit is dropped)
      if (tensors.size() < 2) return false;
      name = tensors[pick(rng, tensors.size())].first;
      return true;
    case 4: {  // the name's bytes mutated (indices, prefixes, keys)
      std::vector<uint8_t> bytes(name.begin(), name.end());
      const size_t max_size = name.size() * 2 + 8;
      bytes.resize(max_size);
      bytes.resize(LLVMFuzzerMutate(bytes.data(), name.size(), max_size));
      name.assign(bytes.begin(), bytes.end());
      return true;
    }
    default: tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(i)); return true;
  }
}

// load_checkpoint reads a path. /dev/shm keeps the per-input write in memory where it exists.
const std::string& input_path() {
  static const std::string path = [] {
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : std::getenv("TMPDIR");
    std::string p = std::string(dir != nullptr ? dir : "/tmp") + "/mn-fuzz-checkpoint-" +
                    std::to_string(getpid()) + ".safetensors";
    std::atexit([] { std::remove(input_path().c_str()); });
    return p;
  }();
  return path;
}

void write_input(const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(input_path().c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(input_path().c_str());
    std::abort();  // not the input's fault: stop rather than report nonsense
  }
}

}  // namespace

// Three mutations in four are structural when the input is a readable safetensors file; the rest,
// and every one of an unreadable input, are libFuzzer's byte mutations.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  Rng rng(seed);
  if (pick(rng, 4) != 0) {
    try {
      const st::File file = st::parse(data, size, "<mutation>");
      st::NamedTensors tensors;
      for (const st::Entry& e : file.tensors) tensors.emplace_back(e.name, e.tensor);
      st::StringMap metadata = file.metadata;
      if (mutate_structure(tensors, metadata, rng)) {
        const std::vector<uint8_t> bytes = st::serialize(tensors, metadata);
        if (bytes.size() <= max_size) {
          std::memcpy(data, bytes.data(), bytes.size());
          return bytes.size();
        }
      }
    } catch (const mn::Error&) {
      // Not a readable file, or an edit the writer refuses: mutate the bytes instead.
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_input(data, size);
  const std::string& path = input_path();
  try {
    const mn::mapping::CheckpointInfo info = mn::mapping::read_checkpoint(path);
    auto run = mn::fuzz::make_checkpoint_run(mn::fuzz::setup_for(info));
    mn::mapping::load_checkpoint(path, *run->model, run->trainer.get());
    run->trainer->fit_epoch(*run->loader);  // one batch: one optimizer step on the loaded state
  } catch (const mn::Error&) {
    return 0;  // refused (or a non-finite loss refused by the trainer): the expected outcome
  }
  return 0;
}
