#include "dist/store.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "dist/job_token.h"
#include "dist/socket.h"
#include "dist/store_protocol.h"
#include "dist/tcp_store_server.h"

namespace mn::dist {

namespace {

using net::Clock;
using net::Deadline;

using protocol::counter_text;
using protocol::Op;
using protocol::parse_counter;

// Extra time a client allows the server beyond a wait's own timeout before calling it unresponsive.
constexpr Milliseconds kReplyGrace{10'000};
// Pause between attempts while the server answers "busy" (at its connection limit).
constexpr Milliseconds kBusyRetryPause{100};

std::string seconds_text(Milliseconds ms) { return str(static_cast<double>(ms.count()) / 1000.0, " s"); }

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  return out;
}

// The TcpStore's limits (store.h), checked before anything is sent.
void check_key(const std::string& key) {
  MN_CHECK(key.size() <= kMaxStoreKeyBytes, ValueError, "a store key of ", key.size(), " bytes (limit ",
           kMaxStoreKeyBytes, " bytes, kMaxStoreKeyBytes): '", key.substr(0, 40), "...'");
}

void check_keys(const std::vector<std::string>& keys) {
  MN_CHECK(keys.size() <= kMaxStoreKeysPerRequest, ValueError, keys.size(), " keys in one store request (limit ",
           kMaxStoreKeysPerRequest, ")");
  for (const auto& k : keys) check_key(k);
}

}  // namespace

void throw_store_timeout(const std::vector<std::string>& missing, Milliseconds timeout, const std::string& where) {
  throw RuntimeError(str("timed out after ", seconds_text(timeout), " waiting for key(s) ", join_keys(missing),
                         " in the ", where,
                         " (a rank may have exited or not started; check the other ranks' output)"));
}

// ---------------------------------------------------------------------------------------------------
// HashStore

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

Bytes HashStore::get(const std::string& key) {
  wait({key}, timeout());
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = data_.find(key);
  MN_CHECK(it != data_.end(), RuntimeError, "key '", key, "' was deleted from the HashStore while being read");
  return it->second;
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Bytes& slot = data_[key];
    MN_CHECK(parse_counter(slot, value), ValueError, "HashStore key '", key,
             "' holds a value that is not an integer counter");
    value += delta;
    slot = counter_text(value);
  }
  changed_.notify_all();
  return value;
}

void HashStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto all_present = [&] {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
  };
  if (changed_.wait_for(lock, timeout, all_present)) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!data_.count(k)) missing.push_back(k);
  throw_store_timeout(missing, timeout, "HashStore");
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) > 0;
}

// ---------------------------------------------------------------------------------------------------
// TcpStore (client side; rank 0 also owns the server)

TcpStore::TcpStore(TcpStoreOptions options) : Store(options.timeout), options_(std::move(options)) {
  token_ = options_.token;
  if (!token_ && options_.token_from_env) token_ = job_token_from_env();
  MN_CHECK(!token_ || (!token_->empty() && token_->size() <= kMaxJobTokenBytes), ValueError,
           "TcpStoreOptions::token must be 1 to ", kMaxJobTokenBytes, " bytes, got ", token_->size());
  port_ = options_.port;
  if (options_.is_server) {
    TcpStoreServer::Options server;
    server.host = options_.listen_host.empty() ? options_.host : options_.listen_host;
    server.port = options_.port;
    server.token = token_;
    server.handshake_timeout = options_.handshake_timeout;
    server.max_connections = options_.max_connections;
    server_ = std::make_unique<TcpStoreServer>(std::move(server));
    port_ = server_->port();
  }
  MN_CHECK(port_ != 0, ValueError, "TcpStore client needs a port (got 0; only the server may pick one)");
  connect_and_authenticate();
}

size_t TcpStore::server_connections() const { return server_ ? server_->connections() : 0; }

// The client's half of the handshake (dist/store_protocol.h), retried while the server answers "busy".
void TcpStore::connect_and_authenticate() {
  const Deadline deadline = Clock::now() + options_.timeout;
  const std::string address = str(options_.host, ":", port_);
  const std::string token_hint =
      "set MN_JOB_TOKEN, or MN_JOB_TOKEN_FILE (mn-run --job-token-file), to the same token on every node";
  while (true) {
    net::Socket s = net::connect_with_retry(options_.host, port_, deadline);
    net::Writer hello;
    hello.u32(protocol::kMagic).u32(protocol::kVersion);
    std::vector<uint8_t> answer;
    try {
      net::send_frame(s.fd(), hello.data(), deadline, where());
      answer = net::recv_frame(s.fd(), deadline, where(), protocol::kMaxHandshakeFrameBytes);
    } catch (const RuntimeError& e) {
      throw RuntimeError(str("no store handshake from ", address, " (", e.what(),
                             "); is another service listening on MASTER_PORT?"));
    }
    net::Reader in(answer);
    const uint32_t magic = answer.size() >= 8 ? in.u32() : 0;
    MN_CHECK(magic == protocol::kMagic, RuntimeError, "the service at ", address,
             " is not an mn store (bad handshake); is another service listening on MASTER_PORT?");
    const uint32_t version = in.u32();
    MN_CHECK(version == protocol::kVersion, RuntimeError, "store protocol version mismatch: the server at ", address,
             " speaks version ", version, ", this client speaks ", protocol::kVersion,
             " (are all ranks running the same build?)");
    const uint8_t mode = answer.size() > 8 ? in.u8() : 0xff;
    if (mode == protocol::kModeBusy && answer.size() == 9) {
      MN_CHECK(Clock::now() + kBusyRetryPause < deadline, RuntimeError, "the store at ", address,
               " kept refusing the connection: it serves its maximum number of connections (a flood of "
               "connections, or more clients than it allows)");
      std::this_thread::sleep_for(kBusyRetryPause);
      continue;
    }
    MN_CHECK(answer.size() == protocol::kChallengeBytes && mode <= protocol::kModeToken, RuntimeError,
             "the store at ", address, " sent a malformed handshake (", answer.size(), " bytes)");
    const std::vector<uint8_t> server_nonce(answer.begin() + 9, answer.end());
    // The auth frame goes out even when this side will refuse, so the server can log why.
    net::Writer auth;
    std::vector<uint8_t> client_nonce;
    if (token_) {
      client_nonce = crypto::random_bytes(kAuthNonceBytes);
      const crypto::Digest proof = client_auth_proof(*token_, server_nonce, client_nonce);
      auth.u8(1);
      auth.data().insert(auth.data().end(), client_nonce.begin(), client_nonce.end());
      auth.data().insert(auth.data().end(), proof.begin(), proof.end());
    } else {
      auth.u8(0);
    }
    net::send_frame(s.fd(), auth.data(), deadline, where());
    MN_CHECK(mode == protocol::kModeToken || !token_, RuntimeError, "this rank has a job token but the store at ",
             address, " does not ask for one: it was started without the token, or it is not this job's store; ",
             token_hint);
    MN_CHECK(mode == protocol::kModeOpen || token_, RuntimeError, "the store at ", address,
             " requires a job token; ", token_hint);
    if (token_) {
      std::vector<uint8_t> verdict;
      try {
        verdict = net::recv_frame(s.fd(), deadline, where(), protocol::kMaxHandshakeFrameBytes);
      } catch (const RuntimeError& e) {
        throw RuntimeError(str("the store at ", address, " did not answer this rank's job token (", e.what(), ")"));
      }
      MN_CHECK(!verdict.empty() && verdict[0] == 1, RuntimeError, "the store at ", address,
               " refused this rank's job token: the tokens differ; ", token_hint);
      const crypto::Digest expected = server_auth_proof(*token_, server_nonce, client_nonce);
      MN_CHECK(verdict.size() == 1 + expected.size() &&
                   crypto::constant_time_equal(expected.data(), verdict.data() + 1, expected.size()),
               RuntimeError, "the store at ", address,
               " did not prove that it knows the job token: it is not this job's store; refusing to use it");
    }
    socket_ = s.release();
    return;
  }
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) ::close(socket_);
  server_.reset();  // joins the server thread; remaining clients see their connection close
}

std::string TcpStore::where() const { return str("TcpStore at ", options_.host, ":", port_); }

Bytes TcpStore::round_trip(const Bytes& request, Deadline reply_deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  MN_CHECK(socket_ >= 0, RuntimeError, "the connection to the ", where(),
           " was lost by an earlier failure; the store cannot be used any more");
  try {
    net::send_frame(socket_, request, Clock::now() + timeout(), where());
    return net::recv_frame(socket_, reply_deadline, where(), protocol::kMaxFrameBytes);
  } catch (const RuntimeError& e) {
    // A half-sent request or half-read reply leaves the stream out of step: never reuse it.
    ::close(socket_);
    socket_ = -1;
    throw RuntimeError(str(e.what(), " (did rank 0, which serves the store, exit?)"));
  }
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  check_key(key);
  MN_CHECK(value.size() <= kMaxStoreValueBytes, ValueError, "a store value of ", value.size(), " bytes for key '", key,
           "' in the ", where(), " (limit ", kMaxStoreValueBytes, " bytes, kMaxStoreValueBytes)");
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Set)).str(key).bytes(value);
  round_trip(w.data(), Clock::now() + timeout());
}

Bytes TcpStore::get(const std::string& key) {
  check_key(key);
  wait({key}, timeout());
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Get)).str(key);
  Bytes answer = round_trip(w.data(), Clock::now() + timeout());
  net::Reader in(answer);
  MN_CHECK(in.u8() == 1, RuntimeError, "key '", key, "' was deleted from the ", where(), " while being read");
  return in.bytes();
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  check_key(key);
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Add)).str(key).i64(delta);
  Bytes answer = round_trip(w.data(), Clock::now() + timeout());
  net::Reader in(answer);
  if (in.u8() != 1) throw ValueError(in.str());
  return in.i64();
}

void TcpStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  check_keys(keys);
  timeout = std::min(timeout, kMaxStoreWaitTimeout);
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Wait)).u64(static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)));
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  Bytes answer = round_trip(w.data(), Clock::now() + timeout + kReplyGrace);
  if (net::Reader(answer).u8() == 1) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!check({k})) missing.push_back(k);
  throw_store_timeout(missing.empty() ? keys : missing, timeout, where());
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  check_keys(keys);
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Check)).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  return net::Reader(round_trip(w.data(), Clock::now() + timeout())).u8() == 1;
}

bool TcpStore::delete_key(const std::string& key) {
  check_key(key);
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Delete)).str(key);
  return net::Reader(round_trip(w.data(), Clock::now() + timeout())).u8() == 1;
}

// ---------------------------------------------------------------------------------------------------
// PrefixStore

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(store ? store->timeout() : kDefaultStoreTimeout), prefix_(std::move(prefix)), store_(std::move(store)) {
  MN_CHECK(store_ != nullptr, ValueError, "PrefixStore('", prefix_, "') needs an underlying store, got null");
}

std::vector<std::string> PrefixStore::full_keys(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(full_key(k));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { store_->set(full_key(key), value); }
Bytes PrefixStore::get(const std::string& key) { return store_->get(full_key(key)); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return store_->add(full_key(key), delta); }
void PrefixStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  store_->wait(full_keys(keys), timeout);
}
bool PrefixStore::check(const std::vector<std::string>& keys) { return store_->check(full_keys(keys)); }
bool PrefixStore::delete_key(const std::string& key) { return store_->delete_key(full_key(key)); }

// ---------------------------------------------------------------------------------------------------
// World-size agreement

namespace {
constexpr const char* kWorldSizeKey = "mn/world_size/rank0";
std::string world_size_ack_key(int rank) { return str("mn/world_size/rank", rank); }
}  // namespace

void check_world_size(Store& store, int rank, int world_size, Milliseconds timeout) {
  MN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, ValueError, "check_world_size: rank ", rank,
           " is not in [0, ", world_size, ")");
  if (rank == 0) {
    store.set(kWorldSizeKey, std::to_string(world_size));
    // In rank order; a disagreeing rank ends the wait early, and the ranks already heard from are listed.
    for (int r = 1; r < world_size; ++r) {
      store.wait({world_size_ack_key(r)}, timeout);
      if (store.get_string(world_size_ack_key(r)) == std::to_string(world_size)) continue;
      std::vector<std::string> disagree;
      for (int q = r; q < world_size; ++q)
        if (store.check({world_size_ack_key(q)})) {
          const std::string theirs = store.get_string(world_size_ack_key(q));
          if (theirs != std::to_string(world_size)) disagree.push_back(str("rank ", q, " has ", theirs));
        }
      throw ValueError(str("the ranks disagree on WORLD_SIZE: rank 0 has ", world_size, ", ", joined(disagree),
                           "; start every rank with the same WORLD_SIZE (mn-run sets it for each rank it starts)"));
    }
    return;
  }
  // Read rank 0's size before publishing ours: rank 0 may fail (and close its store) as soon as it sees ours.
  store.wait({kWorldSizeKey}, timeout);
  const std::string theirs = store.get_string(kWorldSizeKey);
  store.set(world_size_ack_key(rank), std::to_string(world_size));
  MN_CHECK(theirs == std::to_string(world_size), ValueError, "the ranks disagree on WORLD_SIZE: rank ", rank,
           " has ", world_size, " but rank 0 has ", theirs,
           "; start every rank with the same WORLD_SIZE (mn-run sets it for each rank it starts)");
}

}  // namespace mn::dist

// ---------------------------------------------------------------------------------------------------
// Backend agreement

namespace mn::dist {

namespace {
std::string backend_key(int rank) { return str("mn/backend/rank", rank); }
constexpr const char* kBackendVerdictKey = "mn/backend/verdict";
std::string backend_ack_key(int rank) { return str("mn/backend/ack", rank); }
// How long rank 0 keeps the store up for the others to read a negative verdict before it throws.
constexpr Milliseconds kVerdictReadTime{10'000};
}  // namespace

void check_backend_agreement(Store& store, int rank, int world_size, const std::string& backend,
                             Milliseconds timeout) {
  MN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, ValueError, "check_backend_agreement: rank ", rank,
           " is not in [0, ", world_size, ")");
  if (world_size == 1) return;
  store.set(backend_key(rank), backend);
  if (rank == 0) {
    std::vector<std::string> disagree;
    for (int r = 1; r < world_size; ++r) {
      store.wait({backend_key(r)}, timeout);
      const std::string theirs = store.get_string(backend_key(r));
      if (theirs == backend) continue;
      if (disagree.size() == 8) {
        disagree.push_back("...");
        break;
      }
      disagree.push_back(str("rank ", r, " chose backend '", theirs, "'"));
    }
    const std::string verdict =
        disagree.empty() ? std::string()
                         : str("setup_ddp: ", joined(disagree), " but rank 0 chose '", backend,
                               "'; every rank must use the same backend");
    store.set(kBackendVerdictKey, verdict);
    if (verdict.empty()) return;
    // Rank 0 serves the store: stay until every rank has read the verdict (or a while, if one is gone).
    std::vector<std::string> acks;
    for (int r = 1; r < world_size; ++r) acks.push_back(backend_ack_key(r));
    try {
      store.wait(acks, std::min(timeout, kVerdictReadTime));
    } catch (const Error&) {
    }
    throw ValueError(verdict);
  }
  store.wait({kBackendVerdictKey}, timeout);
  const std::string verdict = store.get_string(kBackendVerdictKey);
  store.set(backend_ack_key(rank), std::string("read"));
  if (!verdict.empty()) throw ValueError(verdict);
}

}  // namespace mn::dist
