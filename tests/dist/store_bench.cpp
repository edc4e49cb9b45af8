// Store benchmark (a program, not a test): the cost of the job token's handshake and the latency of
// set/get, with the server in this process on 127.0.0.1 (its thread and the client share the machine).
//
//   mn_store_bench [--repeats 100] [--ops 2000] [--flood 300]
//
// Prints the median (and 10th / 90th percentile) of: connect + handshake of a new client without a token
// and with one (MN_STORE_BENCH_NO_TOKEN builds leave the token out, to time an older store the same way),
// the same with --flood idle connections held open to the server, then set and get of a 64-byte value on
// one connection.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dist/socket.h"
#include "dist/store.h"

using namespace mn::dist;
using Clock = std::chrono::steady_clock;

namespace {

struct Summary {
  double p10, median, p90;
};

Summary summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[static_cast<size_t>(q * static_cast<double>(us.size() - 1))]; };
  return {at(0.1), at(0.5), at(0.9)};
}

void print(const char* what, const Summary& s) {
  std::printf("%-34s median %8.1f us   p10 %8.1f   p90 %8.1f\n", what, s.median, s.p10, s.p90);
}

TcpStoreOptions options(uint16_t port, bool server, [[maybe_unused]] const char* token) {
  TcpStoreOptions o;
  o.port = port;
  o.is_server = server;
  o.timeout = std::chrono::milliseconds(10'000);
#ifndef MN_STORE_BENCH_NO_TOKEN
  o.token_from_env = false;
  if (token != nullptr) o.token = std::string(token);
#endif
  return o;
}

Summary time_handshakes(const char* token, int repeats, int flood = 0) {
  TcpStore server(options(0, true, token));
  std::vector<net::Socket> idle;  // connected, never a byte sent
  for (int i = 0; i < flood; ++i)
    idle.push_back(net::connect_with_retry("127.0.0.1", server.port(), Clock::now() + std::chrono::seconds(5)));
  std::vector<double> us;
  for (int i = 0; i < repeats + 5; ++i) {
    const auto start = Clock::now();
    { TcpStore client(options(server.port(), false, token)); }
    const double t = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    if (i >= 5) us.push_back(t);  // the first few warm the caches
  }
  return summarize(us);
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 100, ops = 2000, flood = 300;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--flood") == 0) flood = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--repeats") == 0) repeats = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--ops") == 0) ops = std::atoi(argv[i + 1]);
  }
  print("connect + handshake, no token", time_handshakes(nullptr, repeats));
#ifndef MN_STORE_BENCH_NO_TOKEN
  print("connect + handshake, job token", time_handshakes("a-job-token-of-32-bytes-length!!", repeats));
  const std::string flooded = "  ... with " + std::to_string(flood) + " idle connections";
  print(flooded.c_str(), time_handshakes("a-job-token-of-32-bytes-length!!", repeats, flood));
#endif
  TcpStore server(options(0, true, nullptr));
  TcpStore client(options(server.port(), false, nullptr));
  const std::string value(64, 'v');
  std::vector<double> set_us, get_us;
  for (int i = 0; i < ops; ++i) {
    const std::string key = "key" + std::to_string(i % 64);
    auto t0 = Clock::now();
    client.set(key, value);
    auto t1 = Clock::now();
    const mn::dist::Bytes got = client.get(key);
    auto t2 = Clock::now();
    if (got.size() != value.size()) return 1;
    set_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    get_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  print("set, 64-byte value", summarize(set_us));
  print("get (wait + get), 64-byte value", summarize(get_us));
  return 0;
}
