// keel run's wait for a killed job's ranks to be gone (run/child.h wait_gone): a process that
// exits is gone once it is a zombie (nobody reaps it here, as nobody reaps a rank whose launcher
// died but init); a process whose leader thread exited while another thread still runs is not
// gone (the GPU teardown of a killed rank looks so, its lock still held); a live process is
// returned when the time is up.
#include "run/child.h"

#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "common/dir_lock.h"

namespace keel::run {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void reap(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// A child that sleeps `ms` and exits.
pid_t child_exiting_after(int ms) {
  const pid_t pid = fork();
  if (pid == 0) {
    usleep(static_cast<useconds_t>(ms) * 1000);
    _exit(0);
  }
  return pid;
}

void* exit_group_later(void* ms) {
  usleep(static_cast<useconds_t>(*static_cast<int*>(ms)) * 1000);
  _exit(0);  // the whole process
}

// A child whose leader thread exits at once while a second thread lives `ms` more, then ends the
// process: a zombie leader with a thread still running, as a killed rank tearing down its device.
pid_t child_with_a_thread_outliving_its_leader(int ms) {
  const pid_t pid = fork();
  if (pid == 0) {
    static int wait_ms = ms;
    pthread_t t;
    if (pthread_create(&t, nullptr, exit_group_later, &wait_ms) != 0) _exit(1);
    syscall(SYS_exit, 0);  // this thread only
  }
  return pid;
}

TEST(RunWaitGone, AnExitedChildIsGoneOnceItIsAZombie) {
  const pid_t pid = child_exiting_after(300);
  const auto t0 = Clock::now();
  EXPECT_TRUE(wait_gone({pid}, 10.0).empty());
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.2) << "returned before the child exited";
  EXPECT_LT(took, 5.0) << "waited past a zombie";
  reap(pid);
}

TEST(RunWaitGone, ALiveProcessIsReturnedWhenTheTimeIsUp) {
  const pid_t pid = child_exiting_after(30000);
  const auto t0 = Clock::now();
  EXPECT_EQ(wait_gone({pid, -1, 0}, 0.3), std::vector<pid_t>{pid});
  EXPECT_GE(seconds_since(t0), 0.25);
  EXPECT_LT(seconds_since(t0), 5.0);
  reap(pid);
}

TEST(RunWaitGone, AZombieLeaderWithAThreadStillRunningIsNotGone) {
  const pid_t pid = child_with_a_thread_outliving_its_leader(1500);
  usleep(200 * 1000);  // the leader has exited by now; its second thread sleeps on
  EXPECT_EQ(wait_gone({pid}, 0.3), std::vector<pid_t>{pid});
  const auto t0 = Clock::now();
  EXPECT_TRUE(wait_gone({pid}, 10.0).empty());
  EXPECT_LT(seconds_since(t0), 5.0);
  reap(pid);
}

TEST(RunWaitGone, NoSuchProcessIsGone) {
  const pid_t pid = child_exiting_after(0);
  waitpid(pid, nullptr, 0);  // reaped: the pid names nothing now
  EXPECT_TRUE(wait_gone({pid}, 0.0).empty());
}

// A child process holding the keel lock of a directory for `ms`, then exiting; the lock is
// held once this returns.
pid_t child_holding_the_lock(const std::string& dir, int ms) {
  int ready[2];
  if (pipe(ready) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(ready[0]);
    auto r = DirLock::acquire(dir, lock_holder_line("the test's holder"));
    const char ok = r.lock ? '1' : '0';
    if (write(ready[1], &ok, 1) != 1) _exit(2);
    usleep(static_cast<useconds_t>(ms) * 1000);
    _exit(0);
  }
  close(ready[1]);
  char ok = '0';
  if (read(ready[0], &ok, 1) != 1 || ok != '1') ADD_FAILURE() << "the child did not take the lock";
  close(ready[0]);
  return pid;
}

TEST(RunWaitUnlocked, WaitsForTheHolderToLetGo) {
  const std::string dir = testing::TempDir() + "keel_wait_unlocked";
  std::filesystem::create_directories(dir);
  pid_t pid = child_holding_the_lock(dir, 30000);
  auto t0 = Clock::now();
  const std::string holder = wait_unlocked(dir, 0.3);
  EXPECT_NE(holder.find("the test's holder"), std::string::npos) << holder;
  EXPECT_GE(seconds_since(t0), 0.25);
  reap(pid);
  EXPECT_EQ(wait_unlocked(dir, 0.0), "") << "free once its holder is gone";
  pid = child_holding_the_lock(dir, 800);
  t0 = Clock::now();
  EXPECT_EQ(wait_unlocked(dir, 10.0), "");
  EXPECT_GE(seconds_since(t0), 0.5) << "returned while the child still held the lock";
  EXPECT_LT(seconds_since(t0), 5.0);
  reap(pid);
  EXPECT_EQ(wait_unlocked(dir + "/no_such_directory", 1.0), "");
  std::filesystem::remove_all(dir);
}


// thread_states / describe_threads: what a hung rank's threads wait in, read from /proc.

void* read_forever(void* fd) {
  pthread_setname_np(pthread_self(), "keel-probe");
  char c;
  (void)!read(*static_cast<int*>(fd), &c, 1);
  return nullptr;
}

void* wait_on_condition(void*) {
  pthread_setname_np(pthread_self(), "keel-sleeper");
  static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
  pthread_mutex_lock(&m);
  for (;;) pthread_cond_wait(&c, &m);
  return nullptr;
}

// A child with a thread blocked reading an empty pipe ("keel-probe"), one waiting on a condition
// variable (a futex: "keel-sleeper") and its main thread in pause().
pid_t child_with_blocked_threads() {
  const pid_t pid = fork();
  if (pid == 0) {
    static int fds[2];
    if (pipe(fds) != 0) _exit(1);
    pthread_t a, b;
    if (pthread_create(&a, nullptr, read_forever, &fds[0]) != 0) _exit(1);
    if (pthread_create(&b, nullptr, wait_on_condition, nullptr) != 0) _exit(1);
    for (;;) pause();
  }
  return pid;
}

const ThreadState* named(const std::vector<ThreadState>& ts, const std::string& name) {
  for (const auto& t : ts)
    if (t.name == name) return &t;
  return nullptr;
}

TEST(RunThreadStates, NamesEachThreadAndWhatItIsBlockedIn) {
  const pid_t pid = child_with_blocked_threads();
  ASSERT_GT(pid, 0);
  std::vector<ThreadState> ts;
  for (int i = 0; i < 100; ++i) {  // until both threads have named themselves and blocked
    ts = thread_states(pid);
    const ThreadState* p = named(ts, "keel-probe");
    const ThreadState* s = named(ts, "keel-sleeper");
    if (ts.size() == 3 && p && s && p->state == 'S' && s->state == 'S') break;
    usleep(20000);
  }
  const std::string line = describe_threads(ts, pid);
  reap(pid);
  ASSERT_EQ(ts.size(), 3u) << line;
  EXPECT_EQ(ts[0].tid, pid);  // sorted: the leader first
  const ThreadState* probe = named(ts, "keel-probe");
  const ThreadState* sleeper = named(ts, "keel-sleeper");
  ASSERT_TRUE(probe && sleeper) << line;
  EXPECT_EQ(probe->state, 'S');
  EXPECT_EQ(sleeper->state, 'S');
  EXPECT_EQ(line.rfind("main S", 0), 0u) << line;
  EXPECT_NE(line.find("keel-probe S"), std::string::npos) << line;  // blocked in read: not plainly asleep
  if (!probe->syscall.empty()) {  // where /proc lets this process see system calls
    EXPECT_EQ(probe->syscall.rfind(std::to_string(SYS_read) + " ", 0), 0u) << probe->syscall;
    EXPECT_NE(line.find("(read)"), std::string::npos) << line;
  }
  if (!sleeper->syscall.empty()) {
    EXPECT_EQ(sleeper->syscall.rfind(std::to_string(SYS_futex) + " ", 0), 0u) << sleeper->syscall;
    EXPECT_EQ(line.find("keel-sleeper"), std::string::npos) << line;  // a futex wait is asleep
    EXPECT_NE(line.find("1 other asleep"), std::string::npos) << line;
  }
}

TEST(RunThreadStates, NoSuchProcessHasNoThreads) {
  const pid_t pid = child_exiting_after(0);
  waitpid(pid, nullptr, 0);
  EXPECT_TRUE(thread_states(pid).empty());
  EXPECT_EQ(describe_threads({}, pid), "its threads could not be read");
}

TEST(RunThreadStates, DescribeShowsTheMainThreadFirstThenTheAwakeOnesUpToTheLimit) {
  const auto thread = [](int tid, const char* name, char state, const std::string& syscall,
                         std::vector<std::string> stack = {}, std::string wchan = "") {
    ThreadState t;
    t.tid = tid, t.name = name, t.state = state, t.syscall = syscall, t.kernel_stack = std::move(stack);
    t.wchan = std::move(wchan);
    return t;
  };
  const std::string futex = fmt::format("{} 0x7f 0x80 0x0", SYS_futex), write = fmt::format("{} 0x3 0x7f 0x100", SYS_write);
  const std::vector<ThreadState> ts = {
      thread(7, "cuda-worker", 'S', futex),
      thread(5, "keel", 'D', write, {"folio_wait_bit_common", "filemap_fdatawait_range", "file_write_and_wait_range", "ext4_sync_file"}),
      thread(8, "keel-ckpt", 'D', "-1 0x0 0x0", {}, "io_schedule"),
      thread(9, "nccl", 'R', "running"),
      thread(10, "reader", 'S', fmt::format("{} 0x4 0x0 0x0", SYS_read)),
      thread(11, "old-kernel", 'S', "", {}, "futex_wait_queue"),
  };
  EXPECT_EQ(describe_threads(ts, 5),
            "main D in folio_wait_bit_common < filemap_fdatawait_range < file_write_and_wait_range (write); "
            "keel-ckpt D in io_schedule (none); nccl R; reader S (read); 2 others asleep");
  EXPECT_EQ(describe_threads(ts, 5, 1),
            "main D in folio_wait_bit_common < filemap_fdatawait_range < file_write_and_wait_range (write); "
            "keel-ckpt D in io_schedule (none); 2 more awake; 2 others asleep");
}

}  // namespace
}  // namespace keel::run
