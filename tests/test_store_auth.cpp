// The store's job token and hardening (issue 20 section 5): SHA-256 / HMAC-SHA256 against the published
// vectors, reading the token from the environment, the challenge-response both ways, and a server that
// survives garbage, half frames, oversized frames and floods of idle connections without leaking
// descriptors or threads. Also the backend agreement setup_ddp runs before building a group.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "dist/hmac.h"
#include "dist/job_token.h"
#include "dist/socket.h"
#include "dist/store.h"
#include "dist/store_protocol.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::dist;
using namespace std::chrono_literals;
using mn::testing::contains;
using mn::testing::error_message;

namespace {

std::string hex_of(const crypto::Digest& d) { return crypto::to_hex(d); }

std::string sha_hex(const std::string& s) { return hex_of(crypto::sha256(s)); }

std::string hmac_hex(const std::string& key, const std::string& data) {
  return hex_of(crypto::hmac_sha256(key.data(), key.size(), data.data(), data.size()));
}

TcpStoreOptions server_options(std::optional<std::string> token,
                               Milliseconds handshake_timeout = kDefaultStoreHandshakeTimeout) {
  TcpStoreOptions o;
  o.handshake_timeout = handshake_timeout;
  o.port = 0;
  o.is_server = true;
  o.timeout = 5000ms;
  o.token = std::move(token);
  o.token_from_env = false;
  return o;
}

TcpStoreOptions client_options(uint16_t port, std::optional<std::string> token, Milliseconds timeout = 5000ms) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  o.token = std::move(token);
  o.token_from_env = false;
  return o;
}

size_t open_descriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

size_t threads() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Waits until `condition` holds or `limit` passes; true when it held.
template <class F>
bool eventually(F condition, Milliseconds limit = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

net::Socket raw_connect(uint16_t port) {
  return net::connect_with_retry("127.0.0.1", port, net::Clock::now() + 5000ms);
}

// True when the server closed the connection within `limit` (whatever it sent before is read and discarded).
bool closed_by_server(const net::Socket& s, Milliseconds limit = 3000ms) {
  const auto end = net::Clock::now() + limit;
  uint8_t buffer[256];
  while (net::Clock::now() < end) {
    pollfd p{s.fd(), POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(s.fd(), buffer, sizeof(buffer), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

void send_frame(const net::Socket& s, const std::vector<uint8_t>& payload) {
  net::send_frame(s.fd(), payload, net::Clock::now() + 2000ms, "the test server");
}

// Hello and auth without a token, by hand; returns the challenge.
std::vector<uint8_t> open_handshake(const net::Socket& s) {
  net::Writer hello;
  hello.u32(protocol::kMagic).u32(protocol::kVersion);
  send_frame(s, hello.data());
  std::vector<uint8_t> challenge = net::recv_frame(s.fd(), net::Clock::now() + 2000ms, "the test server");
  send_frame(s, {0});
  return challenge;
}

// Captures what this process writes to stderr while alive.
class StderrCapture {
 public:
  StderrCapture() : path_(std::filesystem::temp_directory_path() / ("mn_store_log_" + std::to_string(getpid()))) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrCapture() { restore(); }
  std::string text() {
    restore();
    std::ifstream in(path_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  std::filesystem::path path_;
  int saved_ = -1;
};

}  // namespace

TEST_CASE("store auth: SHA-256 matches the FIPS 180-4 examples") {
  CHECK(sha_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(sha_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmn"
                "opqrstnopqrstu") == "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  // One million 'a', fed in uneven pieces (the incremental path and the block boundaries).
  crypto::Sha256 h;
  const std::string piece(997, 'a');
  size_t fed = 0;
  for (size_t step = 1; fed < 1'000'000; step = step % 131 + 1) {
    const size_t n = std::min({step * 7, piece.size(), size_t{1'000'000} - fed});
    h.update(piece.data(), n);
    fed += n;
  }
  CHECK(hex_of(h.finish()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Messages around the padding boundary (55, 56, 63, 64 bytes) agree between one-shot and byte-wise.
  for (size_t n : {55, 56, 63, 64, 65, 119, 120}) {
    const std::string m(n, 'x');
    crypto::Sha256 bytewise;
    for (char c : m) bytewise.update(&c, 1);
    CHECK(hex_of(bytewise.finish()) == sha_hex(m));
  }
}

TEST_CASE("store auth: HMAC-SHA256 matches RFC 4231") {
  CHECK(hmac_hex(std::string(20, '\x0b'), "Hi There") ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(hmac_hex("Jefe", "what do ya want for nothing?") ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(hmac_hex(std::string(20, '\xaa'), std::string(50, '\xdd')) ==
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4.push_back(static_cast<char>(i));
  CHECK(hmac_hex(key4, std::string(50, '\xcd')) == "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  CHECK(hmac_hex(std::string(20, '\x0c'), "Test With Truncation").substr(0, 32) == "a3b6167473100ee06e0c796c2955552b");
  CHECK(hmac_hex(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First") ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(hmac_hex(std::string(131, '\xaa'),
                 "This is a test using a larger than block-size key and a larger than block-size data. The key needs "
                 "to be hashed before being used by the HMAC algorithm.") ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");

  const uint8_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
  CHECK(crypto::constant_time_equal(a, a, 4));
  CHECK_FALSE(crypto::constant_time_equal(a, b, 4));
  CHECK(crypto::constant_time_equal(a, b, 3));
  const auto r1 = crypto::random_bytes(32), r2 = crypto::random_bytes(32);
  CHECK(r1.size() == 32);
  CHECK(r1 != r2);
  // The two directions' proofs differ (no reflection), and each depends on both nonces.
  CHECK(client_auth_proof("t", r1, r2) != server_auth_proof("t", r1, r2));
  CHECK(client_auth_proof("t", r1, r2) != client_auth_proof("t", r2, r1));
  CHECK(client_auth_proof("t", r1, r2) != client_auth_proof("u", r1, r2));
}

TEST_CASE("store auth: the job token from MN_JOB_TOKEN or MN_JOB_TOKEN_FILE") {
  auto from = [](std::map<std::string, std::string> vars) {
    return job_token_from([&](const std::string& name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    });
  };
  CHECK_FALSE(from({}).has_value());
  CHECK(from({{"MN_JOB_TOKEN", "s3cret"}}) == std::optional<std::string>("s3cret"));
  CHECK(contains(error_message([&] { from({{"MN_JOB_TOKEN", ""}}); }), "MN_JOB_TOKEN is set but empty"));
  CHECK(contains(error_message([&] { from({{"MN_JOB_TOKEN", "a"}, {"MN_JOB_TOKEN_FILE", "/x"}}); }),
                 "set only one of them"));
  CHECK(contains(error_message([&] { from({{"MN_JOB_TOKEN", std::string(kMaxJobTokenBytes + 1, 'x')}}); }),
                 "at most 4096"));

  const auto dir = std::filesystem::temp_directory_path() / ("mn_token_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = (dir / name).string();
    std::ofstream(path, std::ios::binary) << text;
    ::chmod(path.c_str(), mode);
    return path;
  };
  CHECK(from({{"MN_JOB_TOKEN_FILE", write("good", "tok en\n", 0600)}}) == std::optional<std::string>("tok en"));
  CHECK(from({{"MN_JOB_TOKEN_FILE", write("crlf", "abc\r\n\n", 0400)}}) == std::optional<std::string>("abc"));
  const std::string open_file = write("open", "abc\n", 0644);
  const std::string readable = error_message([&] { from({{"MN_JOB_TOKEN_FILE", open_file}}); });
  CHECK(contains(readable, "accessible by group or others (mode 644)"));
  CHECK(contains(readable, "chmod 600 " + open_file));
  const std::string empty_file = write("empty", "\n\n", 0600);
  CHECK(contains(error_message([&] { from({{"MN_JOB_TOKEN_FILE", empty_file}}); }), "is empty"));
  const std::string missing = (dir / "missing").string();
  const std::string no_file = error_message([&] { from({{"MN_JOB_TOKEN_FILE", missing}}); });
  CHECK(contains(no_file, "MN_JOB_TOKEN_FILE='" + missing + "': cannot open the job token file"));
  const std::string big = write("big", std::string(10000, 'x'), 0600);
  CHECK(contains(error_message([&] { from({{"MN_JOB_TOKEN_FILE", big}}); }), "is it the right file?"));
  CHECK(contains(error_message([&] { from({{"MN_JOB_TOKEN_FILE", dir.string()}}); }), "not a regular file"));

  // Through the real environment: a default TcpStoreOptions picks the token up with no code change.
  setenv("MN_JOB_TOKEN", "from-env", 1);
  {
    TcpStoreOptions o;
    o.port = 0;
    o.is_server = true;
    o.timeout = 3000ms;
    TcpStore server(o);
    CHECK(server.has_token());
    TcpStoreOptions c;
    c.port = server.port();
    c.timeout = 3000ms;
    TcpStore client(c);
    client.set("k", std::string("v"));
    CHECK(server.get_string("k") == "v");
    CHECK(contains(error_message([&] { TcpStore none(client_options(server.port(), std::nullopt)); }),
                   "requires a job token"));
  }
  unsetenv("MN_JOB_TOKEN");
  std::filesystem::remove_all(dir);
}

TEST_CASE("store auth: challenge-response accepts the job's token and refuses the others") {
  const size_t fds_before = open_descriptors();
  const size_t threads_before = threads();
  {
    StderrCapture log;
    TcpStore server(server_options("job-secret"));
    const uint16_t port = server.port();
    TcpStore good(client_options(port, "job-secret"));
    good.set("nccl/unique_id", std::string("id"));
    CHECK(server.get_string("nccl/unique_id") == "id");

    const std::string wrong = error_message([&] { TcpStore c(client_options(port, "guess")); });
    CHECK(contains(wrong, "the store at 127.0.0.1:" + std::to_string(port) + " refused this rank's job token"));
    CHECK(contains(wrong, "MN_JOB_TOKEN"));
    const std::string missing = error_message([&] { TcpStore c(client_options(port, std::nullopt)); });
    CHECK(contains(missing, "the store at 127.0.0.1:" + std::to_string(port) + " requires a job token; set MN_JOB_TOKEN"));

    TcpStore open_server(server_options(std::nullopt));
    const std::string extra = error_message([&] { TcpStore c(client_options(open_server.port(), "job-secret")); });
    CHECK(contains(extra, "this rank has a job token but the store at 127.0.0.1:" +
                              std::to_string(open_server.port()) + " does not ask for one"));
    TcpStore open_client(client_options(open_server.port(), std::nullopt));  // no token on either side works
    open_client.set("a", std::string("b"));
    CHECK(open_server.get_string("a") == "b");

    // The refusals do not disturb the job: the good client still works, and the server dropped the others.
    CHECK(good.get_string("nccl/unique_id") == "id");
    CHECK(eventually([&] { return server.server_connections() == 2; }));  // the server's own client and `good`
    const std::string text = log.text();
    CHECK(contains(text, "mn store (port " + std::to_string(port) + "): refused the connection from 127.0.0.1:"));
    CHECK(contains(text, ": wrong job token"));
    CHECK(contains(text, ": no job token (this store requires one)"));
    CHECK(contains(text, "the client has a job token but this store has none"));
  }
  CHECK(eventually([&] { return open_descriptors() == fds_before && threads() == threads_before; }));
  CHECK(open_descriptors() == fds_before);
}

TEST_CASE("store auth: a server that does not know the token is not trusted") {
  // An impostor answers the handshake in token mode but cannot compute the proof.
  uint16_t port = 0;
  net::Socket listener = net::listen_on("127.0.0.1", 0, &port);
  std::thread impostor([&] {
    pollfd p{listener.fd(), POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
    net::Socket s(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    const auto deadline = net::Clock::now() + 5000ms;
    net::recv_frame(s.fd(), deadline, "client");
    net::Writer challenge;
    challenge.u32(protocol::kMagic).u32(protocol::kVersion).u8(protocol::kModeToken);
    for (uint8_t b : crypto::random_bytes(kAuthNonceBytes)) challenge.u8(b);
    net::send_frame(s.fd(), challenge.data(), deadline, "client");
    const std::vector<uint8_t> auth = net::recv_frame(s.fd(), deadline, "client");
    CHECK(auth.size() == protocol::kAuthBytesWithToken);
    net::Writer accept;
    accept.u8(1);
    for (uint8_t b : crypto::random_bytes(32)) accept.u8(b);
    net::send_frame(s.fd(), accept.data(), deadline, "client");
    std::this_thread::sleep_for(200ms);
  });
  const std::string message = error_message([&] { TcpStore c(client_options(port, "job-secret")); });
  impostor.join();
  CHECK(contains(message, "did not prove that it knows the job token: it is not this job's store"));
}

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

TEST_CASE("dist rendezvous: ranks that chose different backends all fail, naming them") {
  auto run = [](const std::vector<std::string>& backends) {
    HashStore store(3000ms);
    std::vector<std::string> errors(backends.size());
    std::vector<std::thread> ranks;
    for (size_t r = 0; r < backends.size(); ++r)
      ranks.emplace_back([&, r] {
        errors[r] = error_message([&] {
          check_backend_agreement(store, static_cast<int>(r), static_cast<int>(backends.size()), backends[r], 3000ms);
        });
      });
    for (auto& t : ranks) t.join();
    return errors;
  };
  for (const std::string& e : run({"gloo", "gloo", "gloo"})) CHECK(e.empty());
  const auto errors = run({"gloo", "nccl", "gloo"});
  for (const std::string& e : errors)
    CHECK(e == "setup_ddp: rank 1 chose backend 'nccl' but rank 0 chose 'gloo'; every rank must use the same backend");
  const auto two = run({"nccl", "gloo", "mpi"});
  CHECK(two[2] == "setup_ddp: rank 1 chose backend 'gloo', rank 2 chose backend 'mpi' but rank 0 chose 'nccl'; "
                  "every rank must use the same backend");
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
