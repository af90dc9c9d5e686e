// The canonical spelling of a URL qcowfs opens (io::is_remote_location), so
// that equivalent spellings of one remote image meet: a mount's control socket
// is keyed by it (io/control_socket.h), and the daemon and `qcowfs snapshot`
// both reach it through control_socket_name, which calls this.
//
// libcurl's URL API parses (loaded lazily, io/remote/curl_loader.cc); nothing
// here parses a URL by hand (printable_remote_location only cuts text).
//  - http, https: scheme and host lower-case, the default port dropped, dot
//    segments removed, characters curl would encode encoded
//    (CURLU_URLENCODE), an empty path "/", the fragment dropped (never sent),
//    the password dropped (it proves who asks, it names nothing; the user name
//    is kept, a server may serve users different objects). The query is kept:
//    a presigned S3 URL's X-Amz-* query is part of the object's address.
//  - nbd://HOST[:PORT]/EXPORT: host lower-case, port 10809 dropped, the export
//    name decoded and encoded again (libnbd decodes it), "." and ".." kept
//    (libnbd takes the name literally), query parameters decoded, encoded again
//    and sorted.
//  - nbd+unix:///EXPORT?socket=PATH: as nbd, without host or port (libnbd
//    ignores them there), and the socket path made absolute and canonical
//    (its realpath when the file exists).
//  - s3://BUCKET/KEY and anything curl cannot parse: the text as written. An
//    S3 key is the text after the bucket, byte for byte (io/remote/s3.cc
//    encodes '%', '.' segments and all), and a bucket's case matters under
//    path-style addressing: there is no other spelling of the same object.
// Two spellings that meet name the same image; two that do not may still (a
// host name and its address, two servers of one file): those miss the daemon
// as before. The result may hold the URL's user name: hash it, never log it.
//
// Thread-safety: a plain function (the libcurl calls are thread-safe); it
// reads the file system for an nbd+unix socket's path.
#pragma once

#include <string>
#include <string_view>

namespace qcowfs::io {

std::string canonical_remote_location(std::string_view url);

// The URL as qcowfs shows it in logs, messages, the status file and the mount
// table (/proc/mounts, readable by every user): http and https without the
// password, the query (a presigned URL's signature) and the fragment; nbd,
// nbd+unix and s3 URLs as written (they hold no secret: libnbd URIs carry no
// password, S3 keys come from the environment or a file). An http(s) URL is
// cut as text (before any '?' or '#', "user:password@" to "user@"), so this
// works without libcurl and on URLs curl refuses.
std::string printable_remote_location(std::string_view url);

}  // namespace qcowfs::io
