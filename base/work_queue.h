// One thread running closures in the order they were enqueued: a host device stream, or the optimizer's
// background step. drain() returns once everything enqueued before it has run.
#pragma once

#include "base/private.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "base/thread_role.h"

namespace zoe {

class WorkQueue {
 public:
  WorkQueue() : thread_([this] { loop(); }) {}
  ~WorkQueue() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();  // runs what is still queued first
  }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void enqueue(std::function<void()> work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
      ++enqueued_;
    }
    cv_.notify_all();
  }

  void drain() {
    std::unique_lock lock(mutex_);
    const unsigned long long target = enqueued_;
    cv_.wait(lock, [&] { return done_ >= target; });
  }

 private:
  void loop() {
    mark_worker_thread();  // its host waits are zoe's own, not the trainer's
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
      {
        std::lock_guard lock(mutex_);
        ++done_;
      }
      cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  unsigned long long enqueued_ = 0, done_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members it uses exist
};

}  // namespace zoe
