#include "arena.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "errors.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and we touch pages by hand
#endif

namespace foresight {

Mapping::Mapping(size_t size_, bool hugepages, bool populate) : size(size_) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        throw SystemError(cat("arena: mmap of ", size, " bytes failed: ", std::strerror(err)), err);
    }
    data = static_cast<uint8_t*>(p);
    // Advice must come before the first touch to get huge pages; failure only costs speed.
    if (hugepages) hugepages_advised = madvise(data, size, MADV_HUGEPAGE) == 0;
    if (populate && madvise(data, size, MADV_POPULATE_WRITE) != 0) {
        if (errno != EINVAL) {
            int err = errno;
            munmap(data, size);
            throw SystemError(cat("arena: pre-touching ", size, " bytes failed: ", std::strerror(err)), err);
        }
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        for (size_t off = 0; off < size; off += page) static_cast<volatile uint8_t*>(data)[off] = 0;
    }
}

Mapping::~Mapping() {
    if (data) munmap(data, size);  // cannot fail for a range we mapped ourselves
}

Arena::Arena(const ArenaOptions& o) : page_size_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    if (o.slot_bytes == 0) throw InputError("arena: slot_bytes must be > 0");
    if (o.slots == 0) throw InputError("arena: slots must be > 0");
    slot_bytes_ = (o.slot_bytes + page_size_ - 1) / page_size_ * page_size_;
    slots_ = o.slots;
    if (slot_bytes_ < o.slot_bytes || slots_ > SIZE_MAX / slot_bytes_)
        throw InputError(cat("arena: ", o.slots, " slots of ", o.slot_bytes, " bytes overflow the address space"));
    mapping_ = std::make_shared<Mapping>(nbytes(), o.hugepages, o.populate);
    watch_ = mapping_;
    hugepages_advised_ = mapping_->hugepages_advised;
    in_use_.assign(slots_, false);
    for (size_t i = slots_; i-- > 0;) free_.push_back(i);  // slot 0 comes out first
}

std::shared_ptr<Mapping> Arena::mapping() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!mapping_) throw ClosedError("arena: used after close()");
    return mapping_;
}

void Arena::check_index(size_t i, const char* what) const {
    if (i >= slots_) throw InputError(cat("arena: ", what, " of slot ", i, " but the arena has ", slots_, " slots"));
}

uint8_t* Arena::slot_data(size_t i) const {
    check_index(i, "access");
    return mapping()->data + i * slot_bytes_;
}

long Arena::acquire(double timeout_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto ready = [this] { return !mapping_ || !free_.empty(); };
    if (timeout_s < 0 || timeout_s > 1e9) {  // also keeps huge/inf timeouts from overflowing chrono
        freed_.wait(lock, ready);
    } else if (!freed_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
        return -1;
    }
    if (!mapping_) throw ClosedError("arena: acquire on a closed arena");
    size_t i = free_.back();
    free_.pop_back();
    in_use_[i] = true;
    return static_cast<long>(i);
}

void Arena::release(size_t i) {
    check_index(i, "release");
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!in_use_[i]) throw InputError(cat("arena: release of slot ", i, ", which is not acquired"));
        in_use_[i] = false;
        free_.push_back(i);
    }
    freed_.notify_one();
}

size_t Arena::free_slots() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return free_.size();
}

long Arena::live_views() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return watch_.use_count() - (mapping_ ? 1 : 0);
}

void Arena::close() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        mapping_.reset();
    }
    freed_.notify_all();
}

bool Arena::closed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !mapping_;
}

}  // namespace foresight
