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

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace keel::run
