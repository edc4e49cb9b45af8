// The store's job token (issue 20 section 5): SHA-256 / HMAC-SHA256 against the published vectors, reading
// the token from the environment, and the challenge-response both ways. Also the backend agreement
// setup_ddp runs before building a group. The server's hardening is in tests/test_store_hardening.cpp.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "dist/hmac.h"
#include "dist/job_token.h"
#include "dist/store.h"
#include "tests/store_test_support.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::dist;
using namespace mn::store_test;
using namespace std::chrono_literals;
using mn::testing::contains;
using mn::testing::error_message;

namespace {

std::string hex_of(const crypto::Digest& d) { return crypto::to_hex(d); }

std::string sha_hex(const std::string& s) { return hex_of(crypto::sha256(s)); }

std::string hmac_hex(const std::string& key, const std::string& data) {
  return hex_of(crypto::hmac_sha256(key.data(), key.size(), data.data(), data.size()));
}

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

