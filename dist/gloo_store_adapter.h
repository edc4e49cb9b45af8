#pragma once
// Lets Gloo's rendezvous (gloo::rendezvous::Context::connectFullMesh) publish and fetch transport
// addresses through our Store, so one TcpStore serves every backend.
#include <gloo/rendezvous/store.h>

#include <memory>

#include "dist/store.h"

namespace mn::dist {

class GlooStoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(std::shared_ptr<mn::dist::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes value = store_->get(key);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, store_->timeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<mn::dist::Store> store_;
};

}  // namespace mn::dist
