#pragma once
// Devices: the CPU and CUDA devices by index. Kernels are looked up by device type.
#include <cstdint>
#include <ostream>
#include <string>

namespace mn {

enum class DeviceType : uint8_t { CPU = 0, CUDA = 1 };
constexpr int kNumDeviceTypes = 2;

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}
  // Parses "cpu", "cuda", "cuda:1", and "auto" (cuda:0 when a CUDA device is usable, else the CPU,
  // like the reference trainer's device="auto"); throws ValueError on anything else.
  static Device parse(const std::string& text);
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;
  friend bool operator==(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};
constexpr Device kCPU{DeviceType::CPU, 0};
inline Device cuda_device(int index = 0) { return Device(DeviceType::CUDA, index); }
inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

// Number of usable CUDA devices: 0 when built without CUDA or when no driver/device is present.
int cuda_device_count();
bool cuda_available();

}  // namespace mn
