// KV memory under a byte cap: the pool that many sequences' caches share, and FIFO admission.
//
// Every request declares, before it runs, the most bytes its KV cache can ever allocate (its
// peak footprint: KvCache::bytes_for_slots(config, KvPolicy::peak_slots(...)), keys + values +
// slot metadata). It is admitted only when that reservation fits next to the reservations of the
// running sequences, and its cache is capped at exactly that many slots (KvCache::set_slot_limit),
// so at every moment
//     allocated KV bytes of a sequence <= its reservation,  sum of reservations <= cap
// (no overcommit: a running sequence can never be starved of memory and never has to be
// preempted). The reservation is returned when the sequence ends.
//
// Admission is strict FIFO: a request that does not fit yet blocks the ones behind it (none can
// starve), unless nothing runs: then the first that fits goes (admit_first_fitting), since the
// head may be waiting for bytes only requests behind it hold. A request whose own peak exceeds
// the cap could never run and is refused at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"

namespace d2o {

// A byte budget: reservations are taken and returned, never exceeding the cap.
class KvMemoryPool {
 public:
  explicit KvMemoryPool(size_t cap_bytes) : cap_(cap_bytes) {}

  size_t cap() const { return cap_; }
  size_t reserved() const { return reserved_; }
  size_t available() const { return cap_ - reserved_; }
  size_t peak_reserved() const { return peak_reserved_; }

  // Takes `bytes` if they fit (true), else changes nothing (false).
  bool try_reserve(size_t bytes);
  // Returns bytes taken earlier (asserts they were).
  void release(size_t bytes);

 private:
  size_t cap_;
  size_t reserved_ = 0;
  size_t peak_reserved_ = 0;
};

// FIFO admission of requests (identified by the caller's ids) into a pool.
class AdmissionQueue {
 public:
  explicit AdmissionQueue(KvMemoryPool& pool) : pool_(pool) {}

  // Queues request `id` needing `bytes` at its peak. Refused (resource_exhausted, the message
  // gives both sizes) when bytes exceed the cap: it could never be admitted. Ids must be unique.
  // `held` (<= bytes): part of the reservation the caller already holds in the pool (a kept
  // conversation's cache that the request continues); admission takes only the rest, and the
  // whole `bytes` are returned by release(). A refused push leaves `held` with the caller.
  Status push(uint64_t id, size_t bytes, size_t held = 0);
  // Admits requests from the head of the queue while the head's reservation fits and fewer than
  // `max_admit` were admitted by this call; appends their ids to `out`. Never skips the head.
  void admit(int max_admit, std::vector<uint64_t>& out);
  // Admits the first waiting request whose reservation fits, behind the head if need be; false
  // when none fits. The way out when nothing runs and the head waits for bytes that requests
  // behind it hold (conversations they continue, Request::resume_held): one of them runs, and
  // its conversation's bytes can then be given back while it is idle.
  bool admit_first_fitting(std::vector<uint64_t>& out);
  // Waiting request `id` holds `bytes` less than it did (the conversation it continues was
  // compressed): they go back to the pool. Asserts it waits with at least that many held.
  void give_back(uint64_t id, size_t bytes);
  // The waiting requests' ids, the head first.
  std::vector<uint64_t> waiting_ids() const;
  // Returns the reservation of admitted request `id` (when it ends). Asserts it was admitted.
  void release(uint64_t id);
  // The reservation of an admitted request (0 if unknown).
  size_t reserved_for(uint64_t id) const;
  // Takes waiting request `id` out of the queue and returns its held bytes to the pool; false
  // when it is not waiting.
  bool remove(uint64_t id);
  // Bytes the head of the queue still needs from the pool to be admitted (0: none waits).
  size_t head_needs() const {
    return waiting_.empty() ? 0 : waiting_.front().bytes - waiting_.front().held;
  }

  size_t n_waiting() const { return waiting_.size(); }
  size_t n_admitted() const { return admitted_.size(); }
  const KvMemoryPool& pool() const { return pool_; }

 private:
  struct Entry {
    uint64_t id;
    size_t bytes;
    size_t held;  // of `bytes`, already reserved before admission
  };
  KvMemoryPool& pool_;
  std::deque<Entry> waiting_;
  std::vector<Entry> admitted_;  // few: a linear search is fine
};

// Parses a byte count with an optional binary suffix: "1048576", "512K", "512M", "1.5G", "2GiB",
// "64MB" (K, M, G, T = powers of 1024; case-insensitive; an optional trailing "B" or "iB").
// Errors: empty, negative, zero, malformed, or above 2^60 bytes.
Result<size_t> parse_byte_size(std::string_view text);

}  // namespace d2o
