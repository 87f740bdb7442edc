// `--backend nccl`: collectives on GPU memory through NCCL. Under mpirun/srun each process
// drives the GPU of its node-local rank, or the one its launcher bound it to
// (device/rank_gpu.h); with no launcher one process drives every local
// GPU, one NCCL communicator per device created by ncclCommInitAll and driven inside
// ncclGroupStart/End. Sub-groups come from ncclCommSplit of the world communicator.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "bench/comm/backend.h"
#include "bench/comm/nccl_kernels.h"
#include "common/host.h"
#include "common/mpi_session.h"
#include "common/units.h"
#include "common/watchdog.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "device/rank_gpu.h"

namespace keel::bench {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kBF16: return ncclBfloat16;
    case DType::kFP16: return ncclFloat16;
    case DType::kFP32: return ncclFloat32;
  }
  return ncclFloat32;
}

struct Slot {
  int rank = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
  ncclComm_t world = nullptr;
  ncclComm_t group = nullptr;   // == world when the group is the whole world
  int group_rank = -1;          // -1: not in a group this round
  void* send = nullptr;
  void* recv = nullptr;
  std::uint64_t send_cap = 0, recv_cap = 0;
  std::vector<cudaEvent_t> events;
  VerifyCounters* counters = nullptr;  // device memory
  cudaGraphExec_t graph = nullptr;
};

class NcclBackend final : public Backend {
 public:
  explicit NcclBackend(int max_ranks) {
    MPI_Comm_rank(MPI_COMM_WORLD, &proc_rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &procs_);
    const int devices = visible_cuda_devices();
    if (devices == 0) fail("no CUDA device is visible to this process (use --backend mpi for CPU ranks)");
    host_ = host_name();
    if (procs_ > 1) {
      world_ = procs_;
      slots_.resize(1);
      slots_[0].rank = proc_rank_;
      // the node-local rank's GPU, or the one a launcher bound this rank to (device/rank_gpu.h)
      slots_[0].device = bind_rank_gpu();
      ncclUniqueId id;
      if (proc_rank_ == 0) KEEL_NCCL_CHECK(ncclGetUniqueId(&id));
      KEEL_CUDA_CHECK(cudaSetDevice(slots_[0].device));
      PeerWait wait("bootstrapping the NCCL communicator (MPI_Bcast of its id, ncclCommInitRank)");
      mpi_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
      KEEL_NCCL_CHECK(ncclCommInitRank(&slots_[0].world, world_, id, proc_rank_));
    } else {
      if (max_ranks > devices)
        fail("--ranks asks for {} GPUs but this host has {} (launch under mpirun for GPUs on several hosts)",
             max_ranks, devices);
      world_ = devices;
      slots_.resize(static_cast<size_t>(devices));
      std::vector<ncclComm_t> comms(static_cast<size_t>(devices));
      KEEL_NCCL_CHECK(ncclCommInitAll(comms.data(), devices, nullptr));
      for (int d = 0; d < devices; ++d) {
        slots_[static_cast<size_t>(d)].rank = d;
        slots_[static_cast<size_t>(d)].device = d;
        slots_[static_cast<size_t>(d)].world = comms[static_cast<size_t>(d)];
      }
    }
    for (auto& s : slots_) {
      ranks_.push_back(s.rank);
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
      KEEL_CUDA_CHECK(cudaMalloc(&s.counters, sizeof(VerifyCounters)));
    }
  }

  ~NcclBackend() override {
    // Unwinding from an error: a collective may still be in flight or a capture open, and
    // ncclCommDestroy would wait on it forever. Abort instead, so the error reaches the user.
    const bool failing = failed_ || std::uncaught_exceptions() > 0;
    auto release = [failing](ncclComm_t comm) { failing ? ncclCommAbort(comm) : ncclCommDestroy(comm); };
    for (auto& s : slots_) {
      cudaSetDevice(s.device);
      drop_graph(s);
      if (s.group && s.group != s.world) release(s.group);
      if (s.world) release(s.world);
      for (auto e : s.events) cudaEventDestroy(e);
      cudaFree(s.send);
      cudaFree(s.recv);
      cudaFree(s.counters);
      if (s.stream) cudaStreamDestroy(s.stream);
    }
    if (group_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&group_mpi_);
  }

  std::string name() const override { return "nccl"; }
  int world_size() const override { return world_; }
  const std::vector<int>& local_ranks() const override { return ranks_; }

  std::vector<DeviceDescription> local_devices() const override {
    std::vector<DeviceDescription> out;
    for (const auto& s : slots_) {
      cudaDeviceProp p{};
      KEEL_CUDA_CHECK(cudaGetDeviceProperties(&p, s.device));
      char bus[64] = {0};
      cudaDeviceGetPCIBusId(bus, sizeof(bus), s.device);
      DeviceDescription d;
      d.rank = s.rank;
      d.host = host_;
      d.name = p.name;
      d.bus_id = bus;
      d.device = s.device;
      out.push_back(d);
    }
    return out;
  }

  std::map<std::string, std::string> library_versions() const override {
    std::map<std::string, std::string> v;
    int nccl = 0, rt = 0, drv = 0;
    ncclGetVersion(&nccl);
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    v["nccl"] = fmt::format("{}.{}.{}", nccl / 10000, (nccl % 10000) / 100, nccl % 100);
    v["cuda_runtime"] = fmt::format("{}.{}", rt / 1000, (rt % 1000) / 10);
    v["cuda_driver"] = fmt::format("{}.{}", drv / 1000, (drv % 1000) / 10);
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    std::string mpi(text, static_cast<size_t>(len));
    if (auto cut = mpi.find_first_of("\n,"); cut != std::string::npos) mpi.resize(cut);
    v["mpi"] = mpi;
    return v;
  }

  void form_groups(int group_size, bool all_groups) override {
    const int ngroups = all_groups ? world_ / group_size : 1;
    PeerWait wait("forming NCCL communicators (every rank of the group joins)");
    for (auto& s : slots_) {
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      drop_graph(s);
      if (s.group && s.group != s.world) KEEL_NCCL_CHECK(ncclCommDestroy(s.group));
      s.group = nullptr;
      s.group_rank = -1;
    }
    if (group_size == world_) {
      for (auto& s : slots_) {
        s.group = s.world;
        s.group_rank = s.rank;
      }
    } else {
      KEEL_NCCL_CHECK(ncclGroupStart());
      for (auto& s : slots_) {
        const int g = s.rank / group_size;
        const int color = g < ngroups ? g : NCCL_SPLIT_NOCOLOR;
        KEEL_NCCL_CHECK(ncclCommSplit(s.world, color, s.rank, &s.group, nullptr));
      }
      KEEL_NCCL_CHECK(ncclGroupEnd());
      for (auto& s : slots_) {
        if (s.rank / group_size < ngroups) s.group_rank = s.rank % group_size;
        else s.group = nullptr;
      }
    }
    // Processes that take part also get an MPI communicator, for the barrier before timing.
    if (group_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&group_mpi_);
    const bool member = std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.group_rank >= 0; });
    mpi_check(MPI_Comm_split(MPI_COMM_WORLD, member ? 0 : MPI_UNDEFINED, proc_rank_, &group_mpi_), "MPI_Comm_split");
  }

  // NCCL reduces on the device (no scratch the size of a message); its own communicator
  // buffers and the CUDA context's growth are what the 256 MiB margin leaves room for, as in
  // bench mem's check.
  std::string memory_problem(const SweepBuffers& need, int) const override {
    const std::uint64_t bytes = need.send + need.recv;
    for (const auto& s : slots_) {
      std::size_t free_b = 0, total_b = 0;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      const std::uint64_t usable = free_b > (256ull << 20) ? free_b - (256ull << 20) : 0;
      if (bytes > usable)
        return fmt::format(
            "bench comm: the sweep needs {} on GPU {} of {} ({} send + {} receive buffers), but {} of its {} is "
            "free: lower --max (-e)",
            format_size(bytes), s.device, host_, format_size(need.send), format_size(need.recv), format_size(free_b),
            format_size(total_b));
    }
    return "";
  }

  void reserve(std::uint64_t send_bytes, std::uint64_t recv_bytes) override {
    for (auto& s : slots_) {
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      if (send_bytes > s.send_cap) {
        drop_graph(s);
        KEEL_CUDA_CHECK(cudaFree(s.send));
        s.send = nullptr;
        allocate(&s.send, send_bytes, s);
        s.send_cap = send_bytes;
      }
      if (recv_bytes > s.recv_cap) {
        drop_graph(s);
        KEEL_CUDA_CHECK(cudaFree(s.recv));
        s.recv = nullptr;
        allocate(&s.recv, recv_bytes, s);
        s.recv_cap = recv_bytes;
      }
    }
  }

  void measure(const CollectiveCase& c, const TimingPlan& plan, std::vector<RankTiming>* out) override {
    if (!any_member()) return;
    for (const auto& s : slots_)
      if (s.rank == error_rank_) fail("injected failure on rank {} (--inject-error)", s.rank);
    fill(c, 0x5eedull);
    maybe_hang();
    for (int i = 0; i < plan.warmup; ++i) run(c);
    wait_all();
    barrier();

    std::vector<RankTiming> timings;
    for (auto& s : slots_)
      if (s.group_rank >= 0) timings.push_back(RankTiming{s.rank, 0, {}});

    if (plan.graph_replays > 0) {
      capture_graphs(c, plan.iters);
      launch_graphs();  // one replay to upload the graph
      wait_all();
      barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < plan.graph_replays; ++r) launch_graphs();
      wait_all();
      const double per_op = seconds_since(t0) / (static_cast<double>(plan.graph_replays) * plan.iters);
      ensure_events(plan.graph_replays + 1);
      for (int r = 0; r < plan.graph_replays; ++r) {
        record_events(r);
        launch_graphs();
      }
      record_events(plan.graph_replays);
      wait_all();
      collect(timings, per_op, plan.graph_replays, plan.iters);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < plan.iters; ++i) run(c);
      wait_all();
      const double per_op = seconds_since(t0) / plan.iters;
      ensure_events(plan.iters + 1);
      barrier();
      for (int i = 0; i < plan.iters; ++i) {
        record_events(i);
        run(c);
      }
      record_events(plan.iters);
      wait_all();
      collect(timings, per_op, plan.iters, 1);
    }
    for (auto& t : timings) out->push_back(std::move(t));
  }

  void check(const CollectiveCase& c, std::uint64_t seed, double, std::vector<RankCheck>* out) override {
    if (!any_member()) return;
    fill(c, seed);
    run(c);
    const ValueSpec v = make_value_spec(seed, c.nranks, c.dtype);
    const CaseGeometry g = geometry_of(c);
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      if (s.rank == corrupt_rank_) {
        unsigned char raw[4];
        store_from_float(raw, 0, c.dtype, kCorruptValue);
        const std::size_t bytes = dtype_size(c.dtype);
        KEEL_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(output(s, c)) + corrupt_index(c.shape.recv_count) * bytes, raw,
                                        bytes, cudaMemcpyHostToDevice, s.stream));
        PeerWait wait("cudaStreamSynchronize (the checked collective in flight)");
        KEEL_CUDA_CHECK(cudaStreamSynchronize(s.stream));
      }
      const VerifyCounters init{0, ~0ull};
      KEEL_CUDA_CHECK(cudaMemcpyAsync(s.counters, &init, sizeof(init), cudaMemcpyHostToDevice, s.stream));
      launch_verify(output(s, c), c.shape.recv_count, c.dtype, v, g, s.group_rank, s.counters, s.stream);
    }
    wait_all();
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      VerifyCounters vc{};
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaMemcpy(&vc, s.counters, sizeof(vc), cudaMemcpyDeviceToHost));
      RankCheck rc;
      rc.rank = s.rank;
      rc.wrong = vc.wrong;
      if (vc.wrong) {
        rc.first_wrong = static_cast<std::int64_t>(vc.first);
        unsigned char raw[4] = {0};
        const std::size_t ts = dtype_size(c.dtype);
        KEEL_CUDA_CHECK(cudaMemcpy(raw, static_cast<const char*>(output(s, c)) + vc.first * ts, ts,
                                   cudaMemcpyDeviceToHost));
        rc.got = load_as_float(raw, 0, c.dtype);
        rc.expected = expected_output(v, g, s.group_rank, vc.first);
      }
      out->push_back(rc);
    }
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void allocate(void** p, std::uint64_t bytes, const Slot& s) {
    const cudaError_t rc = cudaMalloc(p, bytes);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      fail("cannot allocate {} bytes on GPU {} of host {}: {}", bytes, s.device, host_, cudaGetErrorString(rc));
    }
  }

  bool any_member() const {
    return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.group_rank >= 0; });
  }

  static std::size_t ts(const CollectiveCase& c) { return dtype_size(c.dtype); }

  // The input of this rank: its send buffer, or its place inside the receive buffer.
  static void* input(const Slot& s, const CollectiveCase& c) {
    if (!c.in_place) return s.send;
    if (c.op == Collective::kAllGather)
      return static_cast<char*>(s.recv) + static_cast<std::uint64_t>(s.group_rank) * c.shape.send_count * ts(c);
    if (c.op == Collective::kReduceScatter) return s.send;
    return s.recv;
  }
  // NCCL's in-place reduce-scatter writes this rank's block inside the full input vector.
  static void* output(const Slot& s, const CollectiveCase& c) {
    if (c.in_place && c.op == Collective::kReduceScatter)
      return static_cast<char*>(s.send) + static_cast<std::uint64_t>(s.group_rank) * c.shape.recv_count * ts(c);
    return s.recv;
  }

  void fill(const CollectiveCase& c, std::uint64_t seed) {
    const ValueSpec v = make_value_spec(seed, c.nranks, c.dtype);
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaMemsetAsync(s.recv, 0xff, c.shape.recv_count * ts(c), s.stream));  // NaN poison
      if (c.in_place && c.op == Collective::kReduceScatter)
        KEEL_CUDA_CHECK(cudaMemsetAsync(s.send, 0xff, c.shape.send_count * ts(c), s.stream));
      launch_fill_inputs(input(s, c), c.shape.send_count, c.dtype, v, s.group_rank, s.stream);
    }
    wait_all();
  }

  void launch_one(Slot& s, const CollectiveCase& c) {
    const ncclDataType_t type = nccl_type(c.dtype);
    const ncclRedOp_t op = c.redop == RedOp::kAvg ? ncclAvg : ncclSum;
    void* in = input(s, c);
    void* out = output(s, c);
    const int n = c.nranks;
    switch (c.op) {
      case Collective::kAllReduce:
        KEEL_NCCL_CHECK(ncclAllReduce(in, out, c.shape.recv_count, type, op, s.group, s.stream));
        break;
      case Collective::kAllGather:
        KEEL_NCCL_CHECK(ncclAllGather(in, out, c.shape.send_count, type, s.group, s.stream));
        break;
      case Collective::kReduceScatter:
        KEEL_NCCL_CHECK(ncclReduceScatter(in, out, c.shape.recv_count, type, op, s.group, s.stream));
        break;
      case Collective::kBroadcast:
        KEEL_NCCL_CHECK(ncclBroadcast(in, out, c.shape.recv_count, type, c.root, s.group, s.stream));
        break;
      case Collective::kAllToAll: {
        // The MoE dispatch pattern: one send and one receive per peer, grouped (as nccl-tests does).
        const std::uint64_t block = c.shape.send_count / static_cast<std::uint64_t>(n);
        const std::uint64_t bytes = block * ts(c);
        for (int p = 0; p < n; ++p) {
          KEEL_NCCL_CHECK(ncclSend(static_cast<char*>(in) + p * bytes, block, type, p, s.group, s.stream));
          KEEL_NCCL_CHECK(ncclRecv(static_cast<char*>(out) + p * bytes, block, type, p, s.group, s.stream));
        }
        break;
      }
      case Collective::kSendRecv:
        KEEL_NCCL_CHECK(ncclSend(in, c.shape.send_count, type, (s.group_rank + 1) % n, s.group, s.stream));
        KEEL_NCCL_CHECK(ncclRecv(out, c.shape.recv_count, type, (s.group_rank - 1 + n) % n, s.group, s.stream));
        break;
    }
  }

  void barrier() {
    PeerWait wait("MPI_Barrier (before timing)");
    mpi_check(MPI_Barrier(group_mpi_), "MPI_Barrier");
  }

  // Injected fault under a launcher: this process stops, so the others wait in the collective
  // and the watchdog names this rank. One process driving every GPU instead leaves the rank's
  // GPU out of each launch (run, below).
  void maybe_hang() {
    if (procs_ > 1 && hang_rank_ == proc_rank_) hang_forever();
  }

  void run(const CollectiveCase& c) {
    // ncclGroupEnd can block on the peers (connection set-up at a communicator's first use).
    PeerWait wait("launching NCCL collectives (ncclGroupEnd)");
    KEEL_NCCL_CHECK(ncclGroupStart());
    for (auto& s : slots_) {
      if (s.group_rank < 0 || s.rank == hang_rank_) continue;  // an injected hang leaves its peers waiting
      launch_one(s, c);
    }
    KEEL_NCCL_CHECK(ncclGroupEnd());
  }

  // Polls instead of blocking so NCCL's asynchronous errors (a dead peer's proxy, a network
  // failure) surface as errors; a plain hang is left to the harness's watchdog.
  void wait_all() {
    PeerWait wait("waiting for the GPU streams (NCCL collectives in flight)");
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      for (;;) {
        const cudaError_t q = cudaStreamQuery(s.stream);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) fail("GPU {} on host {}: {}", s.device, host_, cudaGetErrorString(q));
        ncclResult_t async = ncclSuccess;
        if (s.group) ncclCommGetAsyncError(s.group, &async);
        if (async != ncclSuccess && async != ncclInProgress)
          fail("NCCL reported an asynchronous error on GPU {} of host {}: {}", s.device, host_,
               ncclGetErrorString(async));
        std::this_thread::yield();
      }
    }
  }

  void ensure_events(int count) {
    for (auto& s : slots_) {
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      while (static_cast<int>(s.events.size()) < count) {
        cudaEvent_t e;
        KEEL_CUDA_CHECK(cudaEventCreate(&e));
        s.events.push_back(e);
      }
    }
  }

  void record_events(int index) {
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaEventRecord(s.events[static_cast<size_t>(index)], s.stream));
    }
  }

  // Per-iteration times from consecutive events; each interval covers `ops_per_interval` ops.
  void collect(std::vector<RankTiming>& timings, double per_op, int intervals, int ops_per_interval) {
    size_t k = 0;
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      RankTiming& t = timings[k++];
      t.seconds_per_op = per_op;
      t.iter_seconds.resize(static_cast<size_t>(intervals));
      for (int i = 0; i < intervals; ++i) {
        float ms = 0;
        KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, s.events[static_cast<size_t>(i)], s.events[static_cast<size_t>(i + 1)]));
        t.iter_seconds[static_cast<size_t>(i)] = ms * 1e-3 / ops_per_interval;
      }
    }
  }

  void capture_graphs(const CollectiveCase& c, int iters) {
    // Free old graphs before the first capture begins: destroying a graph while a stream of
    // this thread is capturing is not permitted and silently invalidates that capture.
    for (auto& s : slots_) {
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      drop_graph(s);
    }
    std::vector<cudaGraph_t> graphs(slots_.size(), nullptr);
    try {
      for (auto& s : slots_) {
        if (s.group_rank < 0) continue;
        KEEL_CUDA_CHECK(cudaSetDevice(s.device));
        KEEL_CUDA_CHECK(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
      }
      for (int i = 0; i < iters; ++i) run(c);
      // End every capture before instantiating any: instantiation is not permitted while a
      // stream this thread captures is still capturing.
      for (size_t i = 0; i < slots_.size(); ++i) {
        if (slots_[i].group_rank < 0) continue;
        KEEL_CUDA_CHECK(cudaSetDevice(slots_[i].device));
        KEEL_CUDA_CHECK(cudaStreamEndCapture(slots_[i].stream, &graphs[i]));
      }
    } catch (...) {
      abandon_captures();
      throw;
    }
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!graphs[i]) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(slots_[i].device));
      KEEL_CUDA_CHECK(cudaGraphInstantiate(&slots_[i].graph, graphs[i], 0));
      KEEL_CUDA_CHECK(cudaGraphDestroy(graphs[i]));
    }
    // Upload every graph before any runs: a first launch uploads implicitly, and when one
    // thread drives several GPUs that upload on GPU 1 can wait behind GPU 0's collective
    // kernel, which waits for GPU 1: a deadlock.
    for (auto& s : slots_) {
      if (s.group_rank < 0) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaGraphUpload(s.graph, s.stream));
    }
    wait_all();
  }

  // Ends any capture still open after an error, so the streams are usable (and the error
  // is the one reported, not a later "operation not permitted when stream is capturing").
  void abandon_captures() {
    for (auto& s : slots_) {
      cudaSetDevice(s.device);
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(s.stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(s.stream, &g);
        if (g) cudaGraphDestroy(g);
      }
    }
    cudaGetLastError();
  }

  void launch_graphs() {
    for (auto& s : slots_) {
      if (s.group_rank < 0 || !s.graph) continue;
      KEEL_CUDA_CHECK(cudaSetDevice(s.device));
      KEEL_CUDA_CHECK(cudaGraphLaunch(s.graph, s.stream));
    }
  }

  static void drop_graph(Slot& s) {
    if (s.graph) cudaGraphExecDestroy(s.graph);
    s.graph = nullptr;
  }

  int proc_rank_ = 0, procs_ = 1, world_ = 1;
  std::string host_;
  std::vector<Slot> slots_;
  std::vector<int> ranks_;
  MPI_Comm group_mpi_ = MPI_COMM_NULL;
};

}  // namespace

std::unique_ptr<Backend> make_nccl_backend(int max_ranks) { return std::make_unique<NcclBackend>(max_ranks); }

}  // namespace keel::bench
