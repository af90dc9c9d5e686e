// S3: how an s3://BUCKET/KEY name becomes signed ranged GETs of an endpoint.
//
// Credentials are resolved as the AWS CLI does: AWS_ACCESS_KEY_ID and
// AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN) from the environment; else
// the profile AWS_PROFILE (default "default") of the shared credentials file
// (AWS_SHARED_CREDENTIALS_FILE, default ~/.aws/credentials; section [NAME]),
// then of the config file (AWS_CONFIG_FILE, default ~/.aws/config; section
// [profile NAME], or [default]). The region is s3-region=, else AWS_REGION,
// AWS_DEFAULT_REGION, the profile's region in the config file, or us-east-1.
// The INI files are parsed by inih (Debian's libinih), after checks that keep
// hostile files out of it (size, NUL bytes, line length); options follow
// botocore's parser (no inline comments, case-insensitive names).
//
// The key is percent-encoded as SigV4 wants it (RFC 3986 unreserved bytes and
// '/' kept, every other byte %XX): libcurl signs the request path as it is
// sent (CURLOPT_AWS_SIGV4 uses the URL's path verbatim as the canonical URI,
// and CURLOPT_PATH_AS_IS keeps "." and ".." segments of a key).
// Thread-safety: functions of their arguments and the environment.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "io/remote/remote_options.h"
#include "io/status.h"

namespace qcowfs::io {

struct S3Credentials {
  std::string access_key;
  std::string secret_key;
  std::string session_token;
  std::string region;  // the profile's region (config file), if any
  std::string source;  // where they came from, for messages: "the environment", "FILE [profile]"
};

// The credentials and region of section in an INI text (a credentials or
// config file's content); nullopt when the section has no keys. Fails on a
// file that is not one (NUL bytes, over 1 MiB, a line over 16 KiB, a parse
// error) or a key given twice. source names the file in messages.
Result<std::optional<S3Credentials>> s3_credentials_from_ini(std::string_view text, std::string_view section,
                                                              std::string_view source);

// The credentials as the AWS CLI finds them (see above).
Result<S3Credentials> resolve_s3_credentials();

// key percent-encoded for a SigV4 request path ('/' kept).
std::string s3_encode_key(std::string_view key);

// "Code: Message" of an S3 error answer's XML body ("" when it has no <Code>).
std::string s3_error_summary(std::string_view body);

// s3://BUCKET/KEY as the endpoint's URL, with the signing (provider string,
// credentials, headers) set in ro.
Result<std::string> s3_request_url(const std::string& name, RemoteOptions& ro);

}  // namespace qcowfs::io
