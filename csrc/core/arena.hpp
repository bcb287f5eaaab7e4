// Arena: page-aligned host memory allocated and pre-touched once, split into equal slots, with a
// blocking acquire/release pool so a loader's memory is bounded by (slots x slot_bytes).
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace foresight {

struct ArenaOptions {
    size_t slot_bytes = 0;   // rounded up to the page size
    size_t slots = 0;
    bool hugepages = false;  // madvise(MADV_HUGEPAGE) before touching; ignored where unsupported
    bool populate = true;    // fault every page in now rather than on first use
};

// One anonymous mapping; unmapped when the last owner (the arena or a view of it) lets go.
struct Mapping {
    uint8_t* data = nullptr;
    size_t size = 0;
    Mapping(size_t size, bool hugepages, bool populate);
    ~Mapping();
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    bool hugepages_advised = false;
};

class Arena {
public:
    explicit Arena(const ArenaOptions& options);  // throws InputError, SystemError

    size_t slot_bytes() const { return slot_bytes_; }
    size_t slots() const { return slots_; }
    size_t nbytes() const { return slot_bytes_ * slots_; }
    size_t page_size() const { return page_size_; }
    bool hugepages_advised() const { return hugepages_advised_; }

    // The mapping (shared: views keep it alive after close()); throws ClosedError after close().
    std::shared_ptr<Mapping> mapping() const;
    uint8_t* slot_data(size_t i) const;  // throws InputError for a bad index, ClosedError after close()

    // Blocks until a slot is free and returns its index, or -1 after timeout_s (< 0: wait forever).
    // Throws ClosedError if the arena is closed before or while waiting.
    long acquire(double timeout_s);
    void release(size_t i);  // throws InputError unless slot i is acquired
    size_t free_slots() const;
    long live_views() const;  // views of the memory that are still alive (owners other than the arena)

    void close();  // wakes waiters; memory is unmapped once no view holds it
    bool closed() const;

private:
    void check_index(size_t i, const char* what) const;

    size_t slot_bytes_, slots_, page_size_;
    bool hugepages_advised_;
    mutable std::mutex mutex_;
    std::condition_variable freed_;
    std::shared_ptr<Mapping> mapping_;  // null once closed
    std::weak_ptr<Mapping> watch_;      // counts views after close too
    std::vector<size_t> free_;          // LIFO: the most recently used slot is warmest in cache
    std::vector<bool> in_use_;
};

}  // namespace foresight
