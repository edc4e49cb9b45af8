#pragma once
// A module's weights as a safetensors file, in both directions, under the module's own dotted names:
// what PyTorch's safetensors.torch.save_file(model.state_dict()) writes and load_file +
// load_state_dict(strict=True) reads.
//
//   mn::nn::save(*net, "weights.safetensors");
//   mn::nn::load(*other, "weights.safetensors");                   // strict: every name must match
//   auto skipped = mn::nn::load(*other, "partial.safetensors", false);  // names skipped, reported
#include <string>

#include "nn/module.h"
#include "nn/safetensors.h"

namespace mn::nn {

// Parameters and buffers (state_dict()) with `metadata` ("format": "pt" unless given), written
// atomically (a failed write leaves an existing file intact).
void save(const Module& module, const std::string& path, const safetensors::StringMap& metadata = {});

// Reads `path` into the module with load_state_dict: strict (default) refuses missing and unexpected
// names, a shape that differs is always an error (naming the file), and nothing changes on an error.
// Returns the names skipped by a non-strict load.
Module::LoadResult load(Module& module, const std::string& path, bool strict = true);

}  // namespace mn::nn
