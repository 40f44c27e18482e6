// Numbers in error messages: formatted with std::to_string, never through iostreams.
#pragma once

#include <cstdint>
#include <string>

namespace offload_ext {

// On the GPU machine the extension is built by a newer g++ than the libstdc++ it loads, and formatting
// an integer through a stream there crashed (strings and dtypes format fine).
inline std::string num(int64_t x) { return std::to_string(x); }
inline std::string num(double x) { return std::to_string(x); }

}  // namespace offload_ext
