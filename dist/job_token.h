#pragma once
// The optional job secret that keeps strangers out of the rendezvous store (dist/store.h, TcpStore).
//
// Where it comes from (job_token_from_env):
//   MN_JOB_TOKEN=SECRET           the token itself;
//   MN_JOB_TOKEN_FILE=PATH        a file holding it (mn-run --job-token-file PATH sets this): trailing
//                                 newlines are stripped, the rest must not be empty, at most
//                                 kMaxJobTokenBytes bytes, and the file must give group and others no
//                                 access at all (chmod 600 or 400): refused otherwise, as ssh does with keys;
//   neither                       no token: the store accepts any client that speaks its protocol.
// Setting both is refused (which one was meant?), as is an empty MN_JOB_TOKEN.
//
// How it is proven (protocol version 2, see dist/store.cpp): the server sends a fresh 32-byte nonce, the
// client answers with its own nonce and HMAC-SHA256(token, server nonce || client nonce || "client"
// context), the server answers with HMAC-SHA256(token, client nonce || server nonce || "server" context).
// Each side compares in constant time; the token itself never crosses the wire, and a rank does not talk
// to (and hand the NCCL unique id to) a server that cannot prove it knows the token either.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dist/hmac.h"

namespace mn::dist {

inline constexpr size_t kMaxJobTokenBytes = 4096;
inline constexpr size_t kAuthNonceBytes = 32;

// The token named by the environment, or nullopt when there is none. ValueError for an empty MN_JOB_TOKEN,
// both variables set, or a bad file (unreadable, empty, too large, readable by group/others); the
// message names the variable and the file.
std::optional<std::string> job_token_from_env();
// The same, reading the variables through `lookup` (tests).
std::optional<std::string> job_token_from(const std::function<std::optional<std::string>(const std::string&)>& lookup);

// The proofs exchanged in the handshake (see above).
crypto::Digest client_auth_proof(const std::string& token, const std::vector<uint8_t>& server_nonce,
                                 const std::vector<uint8_t>& client_nonce);
crypto::Digest server_auth_proof(const std::string& token, const std::vector<uint8_t>& server_nonce,
                                 const std::vector<uint8_t>& client_nonce);

}  // namespace mn::dist
