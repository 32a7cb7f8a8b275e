// Digests the ssh bootstrap checks an uploaded agent with: SHA-256 (the
// agent's cache name, checked with sha256sum where the remote host has it)
// and the POSIX cksum CRC (checked with cksum, which every POSIX host has).
// Both are small and only run over the agent binary, once per process: not
// worth a crypto library.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace spindle {

// Lower-case hex, 64 characters.
std::string sha256_hex(std::string_view bytes);
// What `cksum < file` prints first: the CRC-32 (polynomial 0x04C11DB7, not
// reflected) of the bytes followed by their length, complemented.
std::uint32_t posix_cksum(std::string_view bytes);

}  // namespace spindle
