// The store server's hardening (issue 20 section 5): garbage, half frames, oversized frames and requests,
// silent clients and floods of idle connections are dropped (and logged) while the job's clients keep
// being served, and nothing is leaked: the process's descriptor and thread counts come back.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "dist/hmac.h"
#include "dist/socket.h"
#include "dist/store.h"
#include "dist/store_protocol.h"
#include "tests/store_test_support.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::dist;
using namespace mn::store_test;
using namespace std::chrono_literals;
using mn::testing::contains;
using mn::testing::error_message;

TEST_CASE("store hardening: garbage, huge frames and silent clients are dropped; the job keeps working") {
  const size_t fds_before = open_descriptors();
  {
    StderrCapture log;
    TcpStore server(server_options("tok", 1500ms));
    const uint16_t port = server.port();
    TcpStore client(client_options(port, "tok"));
    client.set("k", std::string("v"));

    // Another protocol's greeting, framed like a hello; then random bytes.
    net::Socket other = raw_connect(port);
    send_frame(other, {'S', 'S', 'H', '-', '2', '.', '0', '-'});
    CHECK(closed_by_server(other));
    net::Socket garbage = raw_connect(port);
    const std::vector<uint8_t> noise = crypto::random_bytes(4096);
    net::send_exact(garbage.fd(), noise.data(), noise.size(), net::Clock::now() + 2000ms, "server");
    CHECK(closed_by_server(garbage));
    // A length prefix of almost 4 GiB: refused at once, nothing allocated.
    net::Socket huge = raw_connect(port);
    const uint8_t prefix[4] = {0xf0, 0xff, 0xff, 0xff};
    net::send_exact(huge.fd(), prefix, 4, net::Clock::now() + 2000ms, "server");
    CHECK(closed_by_server(huge, 1000ms));
    // A right hello, then an auth frame with a bad shape.
    net::Socket bad_auth = raw_connect(port);
    net::Writer hello;
    hello.u32(protocol::kMagic).u32(protocol::kVersion);
    send_frame(bad_auth, hello.data());
    send_frame(bad_auth, {7, 7, 7});
    CHECK(closed_by_server(bad_auth));
    // Connects and says nothing; another sends half a frame: both are dropped at the handshake deadline
    // while the real client is served at once.
    net::Socket silent = raw_connect(port);
    net::Socket half = raw_connect(port);
    net::send_exact(half.fd(), prefix, 2, net::Clock::now() + 2000ms, "server");
    const auto start = std::chrono::steady_clock::now();
    CHECK(client.get_string("k") == "v");
    CHECK(std::chrono::steady_clock::now() - start < 1000ms);  // not held up until their deadline
    CHECK(closed_by_server(silent, 5000ms));
    CHECK(closed_by_server(half, 5000ms));
    CHECK(client.add("n", 2) == 2);
    const std::string text = log.text();
    CHECK(contains(text, "not the store's handshake"));
    CHECK(contains(text, "a frame of 4294967280 bytes during the handshake (limit 128)"));
    CHECK(contains(text, "a malformed authentication message"));
    CHECK(contains(text, "no complete handshake within 1500 ms"));
  }
  CHECK(eventually([&] { return open_descriptors() == fds_before; }));
}

TEST_CASE("store hardening: after the handshake, bad requests and oversized frames are dropped") {
  const size_t fds_before = open_descriptors();
  {
    StderrCapture log;
    TcpStore server(server_options(std::nullopt));
    const uint16_t port = server.port();
    auto bad_request = [&](const std::vector<uint8_t>& payload) {
      net::Socket s = raw_connect(port);
      open_handshake(s);
      send_frame(s, payload);
      return closed_by_server(s);
    };
    CHECK(bad_request({99}));                          // unknown operation
    CHECK(bad_request({static_cast<uint8_t>(protocol::Op::Get), 5, 0, 0, 0, 'a'}));  // key past the end
    net::Writer long_key;
    long_key.u8(static_cast<uint8_t>(protocol::Op::Get)).str(std::string(kMaxStoreKeyBytes + 1, 'k'));
    CHECK(bad_request(long_key.data()));
    net::Writer trailing;
    trailing.u8(static_cast<uint8_t>(protocol::Op::Delete)).str("k").u8(0);
    CHECK(bad_request(trailing.data()));
    net::Writer many;
    many.u8(static_cast<uint8_t>(protocol::Op::Check)).u32(kMaxStoreKeysPerRequest + 1);
    CHECK(bad_request(many.data()));
    // A frame header announcing more than the largest request: dropped before its body arrives.
    {
      net::Socket s = raw_connect(port);
      open_handshake(s);
      net::Writer header;
      header.u32(protocol::kMaxFrameBytes + 1);
      net::send_exact(s.fd(), header.data().data(), 4, net::Clock::now() + 2000ms, "server");
      CHECK(closed_by_server(s, 1000ms));
    }
    // A second request while a WAIT is pending (store clients are synchronous).
    {
      net::Socket s = raw_connect(port);
      open_handshake(s);
      net::Writer wait;
      wait.u8(static_cast<uint8_t>(protocol::Op::Wait)).u64(60000).u32(1).str("never");
      send_frame(s, wait.data());
      net::Writer get;
      get.u8(static_cast<uint8_t>(protocol::Op::Get)).str("x");
      send_frame(s, get.data());
      CHECK(closed_by_server(s));
    }
    const std::string text = log.text();
    CHECK(contains(text, "malformed store request: unknown operation 99"));
    CHECK(contains(text, "malformed store request: a key of 4097 bytes (limit 4096)"));
    CHECK(contains(text, "trailing bytes"));
    CHECK(contains(text, "65537 keys"));
    CHECK(contains(text, "while its WAIT is pending"));

    // The client checks the limits before sending.
    TcpStore client(client_options(port, std::nullopt));
    CHECK(contains(error_message([&] { client.set(std::string(kMaxStoreKeyBytes + 1, 'k'), std::string("v")); }),
                   "a store key of 4097 bytes"));
    CHECK(contains(error_message([&] { client.set("big", Bytes(kMaxStoreValueBytes + 1)); }),
                   "a store value of 67108865 bytes for key 'big'"));
    // The largest value and the longest key still go through.
    const std::string key(kMaxStoreKeyBytes, 'k');
    Bytes largest(kMaxStoreValueBytes, 7);
    largest.back() = 9;
    client.set(key, largest);
    CHECK(server.get(key) == largest);
  }
  CHECK(eventually([&] { return open_descriptors() == fds_before; }));
}

TEST_CASE("store hardening: a flood of idle connections; the connection limit") {
  const size_t fds_before = open_descriptors();
  const size_t threads_before = threads();
  StderrCapture flood_log;
  {
    TcpStore server(server_options("tok", 3000ms));
    const uint16_t port = server.port();
    const size_t fds_serving = open_descriptors();
    std::vector<net::Socket> flood;
    for (int i = 0; i < 300; ++i) flood.push_back(raw_connect(port));
    CHECK(eventually([&] { return server.server_connections() == 301; }));
    const auto start = std::chrono::steady_clock::now();
    TcpStore client(client_options(port, "tok"));
    client.set("k", std::string("v"));
    CHECK(client.get_string("k") == "v");
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(took < 1500ms);  // served long before the flood's handshake deadline
    // The idle ones are dropped at the handshake deadline (the server's side of them is closed).
    CHECK(eventually([&] { return server.server_connections() == 2; }, 8000ms));
    flood.clear();
    CHECK(eventually([&] { return open_descriptors() == fds_serving + 2; }));  // + the client, both ends
    CHECK(client.get_string("k") == "v");
  }
  {
    // 300 refusals, at most 10 lines, then the count of the others (printed when the server stops).
    const std::string text = flood_log.text();
    size_t lines = 0;
    for (size_t at = text.find("refused the connection from"); at != std::string::npos;
         at = text.find("refused the connection from", at + 1))
      ++lines;
    CHECK(lines == 10);
    CHECK(contains(text, "290 more refused connection(s) not shown"));
  }
  {
    // At the limit, new connections are told "busy"; a client retries until a slot frees or its time is up.
    TcpStoreOptions o = server_options(std::nullopt, 600ms);
    o.max_connections = 4;
    TcpStore server(o);  // its own client takes one slot
    std::vector<net::Socket> idle;
    for (int i = 0; i < 3; ++i) idle.push_back(raw_connect(server.port()));
    CHECK(eventually([&] { return server.server_connections() == 4; }));
    StderrCapture log;
    const std::string busy = error_message([&] { TcpStore c(client_options(server.port(), std::nullopt, 300ms)); });
    CHECK(contains(busy, "kept refusing the connection: it serves its maximum number of connections"));
    const auto start = std::chrono::steady_clock::now();
    TcpStore patient(client_options(server.port(), std::nullopt, 5000ms));
    CHECK(std::chrono::steady_clock::now() - start < 3000ms);
    patient.set("x", std::string("1"));
    CHECK(server.get_string("x") == "1");
    CHECK(contains(log.text(), "already serves its maximum of 4 connections"));
  }
  CHECK(eventually([&] { return open_descriptors() == fds_before && threads() == threads_before; }));
  CHECK(open_descriptors() == fds_before);
  CHECK(threads() == threads_before);
}

TEST_CASE("store hardening: decode_request takes any bytes: a request within the limits, or RuntimeError") {
  // Valid requests, then random bit flips, truncations and extensions of them, then pure noise.
  std::vector<std::vector<uint8_t>> seeds;
  {
    net::Writer w;
    w.u8(static_cast<uint8_t>(protocol::Op::Set)).str("key").bytes(Bytes{1, 2, 3});
    seeds.push_back(w.data());
  }
  {
    net::Writer w;
    w.u8(static_cast<uint8_t>(protocol::Op::Wait)).u64(~uint64_t{0}).u32(2).str("a").str("bb");
    seeds.push_back(w.data());
  }
  {
    net::Writer w;
    w.u8(static_cast<uint8_t>(protocol::Op::Add)).str("c").i64(-5);
    seeds.push_back(w.data());
  }
  const protocol::Request wait = protocol::decode_request(seeds[1]);
  CHECK(wait.timeout == kMaxStoreWaitTimeout);  // clamped: no overflow when the server adds it to now
  CHECK(wait.keys == std::vector<std::string>{"a", "bb"});
  const std::vector<uint8_t> noise = crypto::random_bytes(1 << 16);
  size_t cursor = 0;
  auto next = [&] { return noise[cursor++ % noise.size()]; };
  int decoded = 0, refused = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> input = seeds[static_cast<size_t>(i) % seeds.size()];
    switch (next() % 4) {
      case 0:
        input[next() % input.size()] ^= static_cast<uint8_t>(1u << (next() % 8));
        break;
      case 1:
        input.resize(next() % input.size());
        break;
      case 2:
        input.push_back(next());
        break;
      default:
        input.assign(next() % 64, 0);
        for (auto& b : input) b = next();
    }
    try {
      const protocol::Request r = protocol::decode_request(input);
      for (const auto& k : r.keys) CHECK(k.size() <= kMaxStoreKeyBytes);
      CHECK(r.value.size() <= kMaxStoreValueBytes);
      CHECK(r.timeout <= kMaxStoreWaitTimeout);
      ++decoded;
    } catch (const RuntimeError& e) {
      CHECK(contains(e.what(), "malformed store"));
      ++refused;
    }
  }
  CHECK(decoded > 0);
  CHECK(refused > 0);
}
