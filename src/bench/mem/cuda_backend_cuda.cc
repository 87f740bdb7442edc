// `keel bench mem --backend cuda`: the BabelStream kernels on device memory, the copy engine
// within a device (cudaMemcpyAsync D2D), between host and device (pinned and pageable host
// buffers) and between GPUs (cudaMemcpyPeerAsync issued by the source or the destination).
// Times are device events around each sample; small arrays replay a CUDA graph of `batch`
// runs per sample so launch gaps do not swamp what the memory can do.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <thread>

#include "bench/mem/backend.h"
#include "bench/mem/host_verify.h"
#include "bench/mem/stream_kernels.h"
#include "bench/mem/thread_team.h"
#include "bench/mem/values.h"
#include "common/units.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"

namespace keel::bench {

namespace {

static_assert(static_cast<int>(MemOp::kCopy) == kKernelCopy && static_cast<int>(MemOp::kNstream) == kKernelNstream &&
              static_cast<int>(MemOp::kDot) == kKernelDot);

std::string version_string(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

// Device memory that names what did not fit when it cannot be had.
struct DeviceBuffer {
  int device = -1;
  void* ptr = nullptr;
  DeviceBuffer(int dev, std::uint64_t bytes, const char* what) : device(dev) {
    KEEL_CUDA_CHECK(cudaSetDevice(dev));
    const cudaError_t e = cudaMalloc(&ptr, std::max<std::uint64_t>(bytes, 16));
    if (e != cudaSuccess) {
      cudaGetLastError();
      std::size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      fail("out of memory: could not allocate {} for {} on GPU {} ({} free of {}): {}", format_size(bytes), what, dev,
           format_size(free_b), format_size(total_b), cudaGetErrorString(e));
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) {
      cudaSetDevice(device);
      cudaFree(ptr);
    }
  }
};

struct HostBuffer {
  void* ptr = nullptr;
  bool pinned = false;
  HostBuffer(std::uint64_t bytes, bool pin) : pinned(pin) {
    bytes = std::max<std::uint64_t>(bytes, 64);
    if (pin) {
      const cudaError_t e = cudaMallocHost(&ptr, bytes);
      if (e != cudaSuccess) {
        cudaGetLastError();
        fail("out of memory: could not pin {} of host memory: {}", format_size(bytes), cudaGetErrorString(e));
      }
    } else {
      ptr = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
      if (!ptr) fail("out of memory: could not allocate {} of host memory", format_size(bytes));
    }
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() {
    if (pinned) cudaFreeHost(ptr);
    else std::free(ptr);
  }
};

struct Gpu {
  int index = 0;
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;
  StreamVerifyCounters* counters = nullptr;
};

class CudaMemBackend final : public MemBackend {
 public:
  explicit CudaMemBackend(int device) : team_(std::max(1u, std::min(16u, std::thread::hardware_concurrency()))) {
    const int n = visible_cuda_devices();
    if (n == 0) fail("no CUDA device is visible to this process (use --backend cpu for host memory)");
    if (device < 0 || device >= n) fail("--device {} does not exist: {} GPU(s) are visible", device, n);
    device_ = device;
    gpus_.resize(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) {
      Gpu& g = gpus_[static_cast<std::size_t>(d)];
      g.index = d;
      KEEL_CUDA_CHECK(cudaGetDeviceProperties(&g.prop, d));
      KEEL_CUDA_CHECK(cudaSetDevice(d));
      KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
      KEEL_CUDA_CHECK(cudaMalloc(&g.counters, sizeof(StreamVerifyCounters)));
    }
  }

  ~CudaMemBackend() override {
    for (auto& g : gpus_) {
      cudaSetDevice(g.index);
      cudaFree(g.counters);
      if (g.stream) cudaStreamDestroy(g.stream);
    }
  }

  std::string name() const override { return "cuda"; }

  std::vector<MemDevice> devices() const override {
    std::vector<MemDevice> out;
    for (const auto& g : gpus_) {
      MemDevice d;
      d.index = g.index;
      d.name = g.prop.name;
      d.sm_count = g.prop.multiProcessorCount;
      d.l2_bytes = static_cast<std::uint64_t>(g.prop.l2CacheSize);
      d.memory_bytes = g.prop.totalGlobalMem;
      char bus[32] = {0};
      if (cudaDeviceGetPCIBusId(bus, sizeof(bus), g.index) == cudaSuccess) d.bus_id = bus;
      out.push_back(d);
    }
    // The measured device first: single-device ops and the % of peak refer to it.
    std::rotate(out.begin(), out.begin() + device_, out.begin() + device_ + 1);
    return out;
  }

  std::map<std::string, std::string> library_versions() const override {
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    return {{"cuda_runtime", version_string(rt)}, {"cuda_driver", version_string(drv)}};
  }

  std::string unsupported_reason(MemOp op) const override {
    if (is_peer(op) && gpus_.size() < 2) return "needs 2 or more GPUs (1 is visible)";
    return "";
  }

  void check_fits(const MemCase& c) const override {
    const std::uint64_t array = c.elements * mem_type_size(c.type);
    auto need_on = [&](int dev, std::uint64_t bytes) {
      std::size_t free_b = 0, total_b = 0;
      KEEL_CUDA_CHECK(cudaSetDevice(dev));
      KEEL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      // Leave room for the CUDA context's own allocations and fragmentation.
      const std::uint64_t usable = free_b > (256ull << 20) ? free_b - (256ull << 20) : 0;
      if (bytes > usable)
        fail("out of memory: {} of {} arrays needs {} on GPU {} ({}) but {} is free", mem_op_name(c.op),
             format_size(array), format_size(bytes), dev, gpus_[static_cast<std::size_t>(dev)].prop.name,
             format_size(free_b));
    };
    if (is_peer(c.op)) {
      const std::uint64_t per = (is_bidirectional(c.op) ? 2 : 1) * array;
      need_on(c.src, per);
      need_on(c.dst, per);
    } else {
      need_on(device_, static_cast<std::uint64_t>(arrays_needed(c.op)) * array);
    }
    if (is_host_transfer(c.op)) {
      const std::uint64_t host = static_cast<std::uint64_t>(sysconf(_SC_AVPHYS_PAGES)) *
                                 static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
      if (array > host) fail("out of memory: {} needs {} of host memory but {} is free", mem_op_name(c.op),
                             format_size(array), format_size(host));
    }
  }

  MemResult run(const MemCase& c, const MemPlan& plan) override {
    check_fits(c);
    if (is_stream_kernel(c.op)) return run_kernel(c, plan);
    if (c.op == MemOp::kMemcpy) return run_local_copy(c, plan);
    if (is_host_transfer(c.op)) return run_host_transfer(c, plan);
    return run_peer(c, plan);
  }

 private:
  Gpu& gpu(int d) { return gpus_[static_cast<std::size_t>(d)]; }
  bool f64(const MemCase& c) const { return c.type == MemType::kF64; }

  // Times `op` (which enqueues one run on `g.stream`, possibly with work on other streams
  // that it joins back) as warm-up, an estimate for the batch, then plan.iters samples between
  // consecutive events. `graphable` ops are replayed as a CUDA graph when batched.
  MemResult time_op(Gpu& g, const MemPlan& plan, const std::function<void()>& op, bool graphable) {
    MemResult r;
    KEEL_CUDA_CHECK(cudaSetDevice(g.index));
    const int warm = std::max(plan.warmup, 1);
    for (int w = 0; w < warm; ++w) op();
    cudaEvent_t e0, e1;
    KEEL_CUDA_CHECK(cudaEventCreate(&e0));
    KEEL_CUDA_CHECK(cudaEventCreate(&e1));
    // Size the batch from the mean of a few back-to-back runs: one run of a tiny kernel is
    // mostly launch latency and too noisy to decide on alone.
    constexpr int kSizingRuns = 4;
    KEEL_CUDA_CHECK(cudaEventRecord(e0, g.stream));
    for (int k = 0; k < kSizingRuns; ++k) op();
    KEEL_CUDA_CHECK(cudaEventRecord(e1, g.stream));
    KEEL_CUDA_CHECK(cudaEventSynchronize(e1));
    float all_ms = 0;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&all_ms, e0, e1));
    const float one_ms = all_ms / kSizingRuns;
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    r.runs = static_cast<std::uint64_t>(warm) + kSizingRuns;
    r.batch = static_cast<int>(std::clamp(std::ceil(plan.min_sample_us / std::max(one_ms * 1e3, 1e-3)), 1.0, 4096.0));

    cudaGraphExec_t graph = nullptr;
    if (r.batch > 1 && graphable) {
      cudaGraph_t g0;
      KEEL_CUDA_CHECK(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal));
      for (int k = 0; k < r.batch; ++k) op();
      KEEL_CUDA_CHECK(cudaStreamEndCapture(g.stream, &g0));
      KEEL_CUDA_CHECK(cudaGraphInstantiate(&graph, g0, 0));
      cudaGraphDestroy(g0);
      KEEL_CUDA_CHECK(cudaGraphLaunch(graph, g.stream));  // upload and warm the graph
      r.runs += static_cast<std::uint64_t>(r.batch);
    }
    std::vector<cudaEvent_t> ev(static_cast<std::size_t>(plan.iters) + 1);
    for (auto& e : ev) KEEL_CUDA_CHECK(cudaEventCreate(&e));
    KEEL_CUDA_CHECK(cudaEventRecord(ev[0], g.stream));
    for (int it = 0; it < plan.iters; ++it) {
      if (graph) KEEL_CUDA_CHECK(cudaGraphLaunch(graph, g.stream));
      else
        for (int k = 0; k < r.batch; ++k) op();
      KEEL_CUDA_CHECK(cudaEventRecord(ev[static_cast<std::size_t>(it) + 1], g.stream));
    }
    KEEL_CUDA_CHECK(cudaEventSynchronize(ev.back()));
    KEEL_CUDA_CHECK(cudaGetLastError());
    for (int it = 0; it < plan.iters; ++it) {
      float ms = 0;
      KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[static_cast<std::size_t>(it)], ev[static_cast<std::size_t>(it) + 1]));
      r.seconds.push_back(ms * 1e-3 / r.batch);
    }
    r.runs += static_cast<std::uint64_t>(plan.iters) * static_cast<std::uint64_t>(r.batch);
    for (auto e : ev) cudaEventDestroy(e);
    if (graph) cudaGraphExecDestroy(graph);
    return r;
  }

  // Verifies `out` (n elements on GPU g) against kernel's expectation after r.runs runs.
  void verify_device(Gpu& g, int kernel, bool is_f64, void* out, std::uint64_t n, std::uint64_t seed, MemResult& r) {
    KEEL_CUDA_CHECK(cudaSetDevice(g.index));
    const StreamVerifyCounters zero{0, ~0ull};
    KEEL_CUDA_CHECK(cudaMemcpyAsync(g.counters, &zero, sizeof(zero), cudaMemcpyHostToDevice, g.stream));
    launch_stream_verify(kernel, is_f64, out, n, seed, r.runs, g.counters, stream_aux_grid(n, g.prop.multiProcessorCount),
                         g.stream);
    KEEL_CUDA_CHECK(cudaGetLastError());
    StreamVerifyCounters got{};
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&got, g.counters, sizeof(got), cudaMemcpyDeviceToHost, g.stream));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    r.checked = true;
    r.wrong += got.wrong;
    if (got.wrong && r.first_wrong.empty()) {
      const std::size_t es = is_f64 ? 8 : 4;
      double v = 0;
      if (is_f64) {
        KEEL_CUDA_CHECK(cudaMemcpy(&v, static_cast<char*>(out) + got.first * es, es, cudaMemcpyDeviceToHost));
      } else {
        float f = 0;
        KEEL_CUDA_CHECK(cudaMemcpy(&f, static_cast<char*>(out) + got.first * es, es, cudaMemcpyDeviceToHost));
        v = f;
      }
      const double scalar = is_f64 ? kStreamScalar : static_cast<double>(static_cast<float>(kStreamScalar));
      const StreamExpectation e = stream_expected(kernel, seed, got.first, r.runs, scalar, is_f64 ? 0x1p-53 : 0x1p-24);
      r.first_wrong = fmt::format("GPU {} element {}: got {:.9g}, expected {:.9g}", g.index, got.first, v, e.value);
    }
  }

  // Testing: one wrong element where the checker must find it.
  void corrupt(int dev, void* out, std::uint64_t n, bool is_f64) {
    KEEL_CUDA_CHECK(cudaSetDevice(dev));
    const double d = 12288.0;
    const float f = 12288.f;
    KEEL_CUDA_CHECK(cudaMemcpy(static_cast<char*>(out) + (n / 2) * (is_f64 ? 8 : 4), is_f64 ? static_cast<const void*>(&d)
                                                                                        : static_cast<const void*>(&f),
                               is_f64 ? 8 : 4, cudaMemcpyHostToDevice));
  }

  MemResult run_kernel(const MemCase& c, const MemPlan& plan) {
    Gpu& g = gpu(device_);
    const std::uint64_t n = c.elements, bytes = n * mem_type_size(c.type);
    DeviceBuffer a(g.index, bytes, "array a"), b(g.index, bytes, "array b"), cc(g.index, bytes, "array c");
    const int kernel = static_cast<int>(c.op);
    const int grid = stream_grid(kernel, f64(c), n, g.prop.multiProcessorCount);
    DeviceBuffer partials(g.index, static_cast<std::uint64_t>(grid) * 8, "dot partial sums");
    launch_stream_fill(a.ptr, b.ptr, cc.ptr, n, f64(c), plan.seed, c.op == MemOp::kCopy,
                       stream_aux_grid(n, g.prop.multiProcessorCount), g.stream);
    KEEL_CUDA_CHECK(cudaGetLastError());
    // Elementwise kernels: time every launch shape (3 runs each, after one of each to warm up)
    // and keep the fastest. These runs count towards nstream's expected value like any other.
    // launch = -1: the grid-stride loop; 0.. a one-shot variant.
    int launch = -1;
    std::uint64_t trial_runs = 0;
    auto run_once = [&](int shape) {
      if (shape >= 0) launch_stream_kernel_oneshot(kernel, f64(c), a.ptr, b.ptr, cc.ptr, n, shape, g.stream);
      else launch_stream_kernel(kernel, f64(c), a.ptr, b.ptr, cc.ptr, n, partials.ptr, grid, g.stream);
    };
    if (c.op != MemOp::kDot) {
      auto trial = [&](int shape) {
        cudaEvent_t e0, e1;
        KEEL_CUDA_CHECK(cudaEventCreate(&e0));
        KEEL_CUDA_CHECK(cudaEventCreate(&e1));
        KEEL_CUDA_CHECK(cudaEventRecord(e0, g.stream));
        for (int k = 0; k < 3; ++k) run_once(shape);
        KEEL_CUDA_CHECK(cudaEventRecord(e1, g.stream));
        KEEL_CUDA_CHECK(cudaEventSynchronize(e1));
        KEEL_CUDA_CHECK(cudaGetLastError());
        float ms = 0;
        KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        trial_runs += 3;
        return ms;
      };
      for (int shape = -1; shape < kStreamOneshotVariants; ++shape) {
        run_once(shape);
        ++trial_runs;
      }
      float best = trial(-1);
      for (int shape = 0; shape < kStreamOneshotVariants; ++shape) {
        const float t = trial(shape);
        if (t < best) best = t, launch = shape;
      }
    }
    MemResult r = time_op(g, plan, [&] { run_once(launch); }, true);
    r.runs += trial_runs;
    r.launch = launch >= 0 ? stream_oneshot_variant_name(launch) : "grid-stride";
    if (c.op == MemOp::kDot) {
      std::vector<double> p(static_cast<std::size_t>(grid));
      if (f64(c)) {
        KEEL_CUDA_CHECK(cudaMemcpy(p.data(), partials.ptr, p.size() * 8, cudaMemcpyDeviceToHost));
      } else {
        std::vector<float> pf(p.size());
        KEEL_CUDA_CHECK(cudaMemcpy(pf.data(), partials.ptr, pf.size() * 4, cudaMemcpyDeviceToHost));
        std::copy(pf.begin(), pf.end(), p.begin());
      }
      r.dot = 0;
      for (double x : p) r.dot += x;
      // Per-thread chain over the grid-stride loop, then the block's tree (values.h adds levels).
      const std::uint64_t threads = static_cast<std::uint64_t>(grid) * kStreamBlock;
      r.dot_chain = (n + threads - 1) / threads + 8;
      if (plan.corrupt) r.dot *= 1.01;
      return r;
    }
    const int out = stream_output_array(kernel);
    void* o = out == kArrayA ? a.ptr : out == kArrayB ? b.ptr : cc.ptr;
    if (plan.corrupt) corrupt(g.index, o, n, f64(c));
    if (plan.check) verify_device(g, kernel, f64(c), o, n, plan.seed, r);
    return r;
  }

  MemResult run_local_copy(const MemCase& c, const MemPlan& plan) {
    Gpu& g = gpu(device_);
    const std::uint64_t n = c.elements, bytes = n * mem_type_size(c.type);
    DeviceBuffer src(g.index, bytes, "memcpy source"), dst(g.index, bytes, "memcpy destination");
    launch_stream_fill(src.ptr, nullptr, dst.ptr, n, f64(c), plan.seed, true, stream_aux_grid(n, g.prop.multiProcessorCount),
                       g.stream);
    KEEL_CUDA_CHECK(cudaGetLastError());
    MemResult r = time_op(
        g, plan,
        [&] { KEEL_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, g.stream)); }, true);
    if (plan.corrupt) corrupt(g.index, dst.ptr, n, f64(c));
    if (plan.check) verify_device(g, kKernelCopy, f64(c), dst.ptr, n, plan.seed, r);
    return r;
  }

  template <typename T>
  void host_fill(T* p, std::uint64_t n, std::uint64_t seed, bool poison) {
    team_.run([&](int t, int nt) {
      std::uint64_t lo, hi;
      ThreadTeam::slice(n, t, nt, &lo, &hi);
      for (std::uint64_t i = lo; i < hi; ++i)
        p[i] = poison ? std::numeric_limits<T>::quiet_NaN() : static_cast<T>(stream_input(seed, kArrayA, i));
    });
  }

  MemResult run_host_transfer(const MemCase& c, const MemPlan& plan) {
    Gpu& g = gpu(device_);
    KEEL_CUDA_CHECK(cudaSetDevice(g.index));
    const std::uint64_t n = c.elements, bytes = n * mem_type_size(c.type);
    const bool pinned = c.op == MemOp::kH2DPinned || c.op == MemOp::kD2HPinned;
    const bool to_device = c.op == MemOp::kH2DPinned || c.op == MemOp::kH2DPageable;
    HostBuffer host(bytes, pinned);
    DeviceBuffer dev(g.index, bytes, "transfer buffer");
    const int grid = stream_aux_grid(n, g.prop.multiProcessorCount);
    if (to_device) {
      if (f64(c)) host_fill(static_cast<double*>(host.ptr), n, plan.seed, false);
      else host_fill(static_cast<float*>(host.ptr), n, plan.seed, false);
      launch_stream_fill(nullptr, nullptr, dev.ptr, n, f64(c), plan.seed, true, grid, g.stream);
    } else {
      if (f64(c)) host_fill(static_cast<double*>(host.ptr), n, plan.seed, true);
      else host_fill(static_cast<float*>(host.ptr), n, plan.seed, true);
      launch_stream_fill(dev.ptr, nullptr, nullptr, n, f64(c), plan.seed, false, grid, g.stream);
    }
    KEEL_CUDA_CHECK(cudaGetLastError());
    MemResult r = time_op(
        g, plan,
        [&] {
          if (to_device) KEEL_CUDA_CHECK(cudaMemcpyAsync(dev.ptr, host.ptr, bytes, cudaMemcpyHostToDevice, g.stream));
          else KEEL_CUDA_CHECK(cudaMemcpyAsync(host.ptr, dev.ptr, bytes, cudaMemcpyDeviceToHost, g.stream));
        },
        false);  // pageable copies cannot be captured; time both kinds alike
    KEEL_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    if (to_device) {
      if (plan.corrupt) corrupt(g.index, dev.ptr, n, f64(c));
      if (plan.check) verify_device(g, kKernelCopy, f64(c), dev.ptr, n, plan.seed, r);
    } else {
      if (plan.corrupt) {
        if (f64(c)) static_cast<double*>(host.ptr)[n / 2] = 12288.0;
        else static_cast<float*>(host.ptr)[n / 2] = 12288.f;
      }
      if (plan.check) {
        if (f64(c)) verify_on_host(team_, kKernelCopy, static_cast<const double*>(host.ptr), n, plan.seed, r);
        else verify_on_host(team_, kKernelCopy, static_cast<const float*>(host.ptr), n, plan.seed, r);
      }
    }
    return r;
  }

  // Enables direct access between two GPUs where the platform allows it; false means
  // cudaMemcpyPeerAsync stages through the host.
  bool enable_peer(int a, int b) {
    int can_ab = 0, can_ba = 0;
    KEEL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_ab, a, b));
    KEEL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_ba, b, a));
    if (!can_ab || !can_ba) return false;
    for (auto [x, y] : {std::pair{a, b}, std::pair{b, a}}) {
      KEEL_CUDA_CHECK(cudaSetDevice(x));
      const cudaError_t e = cudaDeviceEnablePeerAccess(y, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else KEEL_CUDA_CHECK(e);
    }
    return true;
  }

  MemResult run_peer(const MemCase& c, const MemPlan& plan) {
    if (c.src == c.dst) fail("peer ops need two different GPUs");
    Gpu& s = gpu(c.src);
    Gpu& d = gpu(c.dst);
    const bool p2p = enable_peer(c.src, c.dst);
    const std::uint64_t n = c.elements, bytes = n * mem_type_size(c.type);
    const bool bidir = is_bidirectional(c.op);
    const bool read = c.op == MemOp::kPeerRead || c.op == MemOp::kPeerBidirRead;
    DeviceBuffer fwd_src(s.index, bytes, "peer source"), fwd_dst(d.index, bytes, "peer destination");
    std::optional<DeviceBuffer> back_src, back_dst;
    if (bidir) {
      back_src.emplace(d.index, bytes, "peer source (reverse)");
      back_dst.emplace(s.index, bytes, "peer destination (reverse)");
    }
    auto fill = [&](Gpu& g, void* src_buf, void* dst_buf_on_same_gpu_or_null) {
      KEEL_CUDA_CHECK(cudaSetDevice(g.index));
      launch_stream_fill(src_buf, nullptr, dst_buf_on_same_gpu_or_null, n, f64(c), plan.seed,
                         dst_buf_on_same_gpu_or_null != nullptr, stream_aux_grid(n, g.prop.multiProcessorCount),
                         g.stream);
      KEEL_CUDA_CHECK(cudaGetLastError());
      KEEL_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    };
    fill(s, fwd_src.ptr, bidir ? back_dst->ptr : nullptr);
    fill(d, bidir ? back_src->ptr : nullptr, fwd_dst.ptr);

    // Write: the source's stream issues; read: the destination's stream pulls.
    Gpu& fwd_issuer = read ? d : s;
    Gpu& back_issuer = read ? s : d;
    cudaEvent_t fork, join;
    KEEL_CUDA_CHECK(cudaSetDevice(fwd_issuer.index));
    KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    KEEL_CUDA_CHECK(cudaSetDevice(back_issuer.index));
    KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    auto op = [&] {
      KEEL_CUDA_CHECK(cudaSetDevice(fwd_issuer.index));
      if (bidir) {
        KEEL_CUDA_CHECK(cudaEventRecord(fork, fwd_issuer.stream));
        KEEL_CUDA_CHECK(cudaStreamWaitEvent(back_issuer.stream, fork, 0));
      }
      KEEL_CUDA_CHECK(cudaMemcpyPeerAsync(fwd_dst.ptr, d.index, fwd_src.ptr, s.index, bytes, fwd_issuer.stream));
      if (bidir) {
        KEEL_CUDA_CHECK(cudaSetDevice(back_issuer.index));
        KEEL_CUDA_CHECK(cudaMemcpyPeerAsync(back_dst->ptr, s.index, back_src->ptr, d.index, bytes, back_issuer.stream));
        KEEL_CUDA_CHECK(cudaEventRecord(join, back_issuer.stream));
        KEEL_CUDA_CHECK(cudaSetDevice(fwd_issuer.index));
        KEEL_CUDA_CHECK(cudaStreamWaitEvent(fwd_issuer.stream, join, 0));
      }
    };
    MemResult r = time_op(fwd_issuer, plan, op, false);
    KEEL_CUDA_CHECK(cudaSetDevice(back_issuer.index));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(back_issuer.stream));
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    r.p2p = p2p;
    if (plan.corrupt) corrupt(d.index, fwd_dst.ptr, n, f64(c));
    if (plan.check) {
      verify_device(d, kKernelCopy, f64(c), fwd_dst.ptr, n, plan.seed, r);
      if (bidir) verify_device(s, kKernelCopy, f64(c), back_dst->ptr, n, plan.seed, r);
    }
    return r;
  }

  int device_ = 0;
  std::vector<Gpu> gpus_;
  ThreadTeam team_;
};

}  // namespace

std::unique_ptr<MemBackend> make_cuda_mem_backend(int device) { return std::make_unique<CudaMemBackend>(device); }

}  // namespace keel::bench
