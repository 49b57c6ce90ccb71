#pragma once

// D2O_SANITIZED is 1 in a build under AddressSanitizer or ThreadSanitizer, with g++ (which defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__) or clang (which answers __has_feature instead).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define D2O_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define D2O_SANITIZED 1
#endif
#endif
#ifndef D2O_SANITIZED
#define D2O_SANITIZED 0
#endif
