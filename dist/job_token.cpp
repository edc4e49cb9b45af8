#include "dist/job_token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace mn::dist {

namespace {

constexpr const char* kTokenVariable = "MN_JOB_TOKEN";
constexpr const char* kTokenFileVariable = "MN_JOB_TOKEN_FILE";
// Distinct contexts for the two directions: a proof one side sent can never be replayed as the other's.
constexpr const char* kClientContext = "mn-store job token v2: client proof";
constexpr const char* kServerContext = "mn-store job token v2: server proof";

std::string read_token_file(const std::string& path) {
  auto fail = [&](const std::string& why) -> ValueError {
    return ValueError(str(kTokenFileVariable, "='", path, "': ", why));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw fail(str("cannot open the job token file: ", std::strerror(errno)));
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    throw fail("the job token file is not a regular file");
  }
  if ((info.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    ::close(fd);
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(info.st_mode & 0777));
    throw fail(str("the job token file is accessible by group or others (mode ", mode,
                   "); run 'chmod 600 ", path, "' so only its owner can read the secret"));
  }
  if (static_cast<uint64_t>(info.st_size) > kMaxJobTokenBytes + 2) {
    ::close(fd);
    throw fail(str("the job token file holds ", info.st_size, " bytes; a token has at most ", kMaxJobTokenBytes,
                   " (is it the right file?)"));
  }
  std::string text(kMaxJobTokenBytes + 3, '\0');
  size_t filled = 0;
  while (filled < text.size()) {
    const ssize_t n = ::read(fd, text.data() + filled, text.size() - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw fail(str("reading the job token file failed: ", std::strerror(err)));
    }
    if (n == 0) break;
    filled += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(filled);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  if (text.empty()) throw fail("the job token file is empty (or holds only newlines)");
  if (text.size() > kMaxJobTokenBytes)
    throw fail(str("the token is ", text.size(), " bytes long; at most ", kMaxJobTokenBytes, " are allowed"));
  return text;
}

crypto::Digest proof(const std::string& token, const std::vector<uint8_t>& first, const std::vector<uint8_t>& second,
                     const char* context) {
  std::vector<uint8_t> message(first);
  message.insert(message.end(), second.begin(), second.end());
  message.insert(message.end(), context, context + std::strlen(context));
  return crypto::hmac_sha256(token, message);
}

}  // namespace

std::optional<std::string> job_token_from(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  const std::optional<std::string> token = lookup(kTokenVariable);
  const std::optional<std::string> file = lookup(kTokenFileVariable);
  MN_CHECK(!(token && file), ValueError, "both ", kTokenVariable, " and ", kTokenFileVariable,
           " are set; set only one of them (the token itself, or the file that holds it)");
  if (token) {
    MN_CHECK(!token->empty(), ValueError, kTokenVariable,
             " is set but empty; unset it to run without a job token, or give it the job's secret");
    MN_CHECK(token->size() <= kMaxJobTokenBytes, ValueError, kTokenVariable, " is ", token->size(),
             " bytes long; at most ", kMaxJobTokenBytes, " are allowed");
    return token;
  }
  if (file) {
    MN_CHECK(!file->empty(), ValueError, kTokenFileVariable, " is set but empty; name the job token file");
    return read_token_file(*file);
  }
  return std::nullopt;
}

std::optional<std::string> job_token_from_env() {
  return job_token_from([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

crypto::Digest client_auth_proof(const std::string& token, const std::vector<uint8_t>& server_nonce,
                                 const std::vector<uint8_t>& client_nonce) {
  return proof(token, server_nonce, client_nonce, kClientContext);
}

crypto::Digest server_auth_proof(const std::string& token, const std::vector<uint8_t>& server_nonce,
                                 const std::vector<uint8_t>& client_nonce) {
  return proof(token, client_nonce, server_nonce, kServerContext);
}

}  // namespace mn::dist
