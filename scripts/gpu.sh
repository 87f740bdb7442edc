#!/usr/bin/env bash
# On a GPU machine, in one call: build keel for sm_90, run the whole test suite (GPU tests
# included), run the benchmarks beside their peers, and print a short table last.
#   scripts/gpu.sh [STEP ...]     steps: build test gtest comm latency mpi launch peer memgemm train routing dp ep tp cp lasp tsp compose linattn kernels soak canary preflight decode ckpt ab
#                                 (default: build test comm mpi memgemm; comm includes latency)
# Logs and JSON go to $OUT (the device tool's output folder) or ./out/gpu.
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=${OUT:-out/gpu}
mkdir -p "$out"
build=${KEEL_BUILD_DIR:-build-gpu}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test comm mpi memgemm)
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
# mpi_gtest NAME RANKS FILTER TIMEOUT SUMMARY_REGEX: keel_mpi_tests cases under mpirun, one GPU
# per rank; the log's lines matching SUMMARY_REGEX go to the summary.
mpi_gtest() {
  local name=$1 n=$2 filter=$3 limit=$4 keep=$5 log="$out/${1}_test_$2.log"
  if timeout "$limit" mpirun --allow-run-as-root -n "$n" --bind-to none -x NCCL_NVLS_ENABLE=0 \
      ${KEEL_NCCL_OVER_MPI:+-x KEEL_NCCL_OVER_MPI} \
      "$build/tests/keel_mpi_tests" --gtest_filter="$filter" >"$log" 2>&1; then
    local on="$n GPUs"
    [ -n "${KEEL_NCCL_OVER_MPI:-}" ] && on="$n ranks sharing one GPU"
    note "$name tests on $on: $(grep -c '  OK ' "$log") passed"
    grep -E "$keep" "$log" >>"$summary"
  else
    tail -40 "$log"; note "$name tests on $n GPUs: FAILED (see $(basename "$log"))"
  fi
}

# zaya_model DIR LOG: the ZAYA1-shaped model's keel config in DIR (a short bench/zaya_vs_torch.py
# run) and data it cannot memorize: 6,000 fresh random rows at DIR/random (its own 12 rows are
# learned to a loss near 0.001 in 200 steps, where the loss-spike guard fires on noise).
zaya_model() {
  python3 bench/zaya_vs_torch.py --keel "$build/keel" --out "$1" --steps 2 --warmup 1 --skip-torch --skip-compile \
      >"$2" 2>&1
  python3 -c "import sys; sys.path.insert(0, 'bench'); import numpy as np, zaya_vs_torch as z; d = z.ZAYA8; \
z.write_dataset('$1/random', np.random.default_rng(1).integers(0, d['vocab'], size=(6000, d['seq'] + 1), dtype=np.uint64))" \
      >>"$2" 2>&1
}

# KEEL_GPUS=N (with CUDA_VISIBLE_DEVICES naming N GPUs) runs the steps as on an N-GPU machine.
gpus=${KEEL_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
note "== keel on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) x $gpus, $(date -u +%F)"

for step in "${steps[@]}"; do
  case "$step" in
    build)
      start=$(date +%s)
      if KEEL_BUILD_DIR=$build KEEL_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 ${KEEL_CMAKE_ARGS:-}" scripts/build.sh \
          >"$out/build.log" 2>&1; then
        note "build: ok ($(( $(date +%s) - start )) s)"
      else
        tail -30 "$out/build.log"; note "build: FAILED (see build.log)"; exit 1
      fi ;;
    test)
      # GPU tests one at a time (they time kernels and share the GPUs); the rest 8 at a time.
      gpu_tests='Cuda|cuda|Nccl|Cublas|cublas'
      ctest --test-dir "$build" --output-on-failure -j 8 -E "$gpu_tests" >"$out/test.log" 2>&1
      ctest --test-dir "$build" --output-on-failure -R "$gpu_tests" >>"$out/test.log" 2>&1
      note "test (CPU): $(grep -E 'tests passed|tests failed' "$out/test.log" | head -1)"
      note "test (GPU, serial): $(grep -E 'tests passed|tests failed' "$out/test.log" | tail -1)"
      grep -E '^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)' "$out/test.log" | head -20 | tee -a "$summary" ;;
    gtest)
      # A subset of the GoogleTest cases (KEEL_GTEST_FILTER), e.g. the multi-GPU ones.
      timeout 300 "$build/tests/keel_tests" --gtest_filter="${KEEL_GTEST_FILTER:-*Nccl*:*Cuda*}" >"$out/gtest.log" 2>&1
      note "gtest ${KEEL_GTEST_FILTER:-*Nccl*:*Cuda*}: $(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest.log" | tr '\n' ' ')"
      grep -E '^\[  FAILED  \] [A-Za-z]' "$out/gtest.log" | sort -u | head -20 | tee -a "$summary" ;;
    comm)
      if [ "$gpus" -lt 2 ]; then note "comm: skipped (needs 2+ GPUs)"; continue; fi
      python3 bench/comm_vs_nccl_tests.py --keel "$build/keel" --nccl-tests .peer/nccl-tests --out "$out" \
        ${KEEL_COMM_ARGS:-} 2>&1 | tee "$out/comm_vs_nccl_tests.log" | tail -60
      grep -A100 '^== bench comm vs nccl-tests' "$out/comm_vs_nccl_tests.log" >>"$summary" ;;
    latency)
      if [ "$gpus" -lt 2 ]; then note "latency: skipped (needs 2+ GPUs)"; continue; fi
      python3 bench/comm_vs_nccl_tests.py --keel "$build/keel" --nccl-tests .peer/nccl-tests --out "$out" \
        --latency-only 2>&1 | tee "$out/comm_latency.log" | tail -30
      grep -A60 '^== latency' "$out/comm_latency.log" >>"$summary" ;;
    mpi)
      if [ "$gpus" -lt 2 ]; then note "mpi: skipped (needs 2+ GPUs)"; continue; fi
      # One process per GPU under mpirun: every op, dtype, reduce op and placement, checked.
      if mpirun --allow-run-as-root -n "$gpus" --bind-to none "$build/keel" bench comm --op all --dtype bf16,fp16,fp32 \
          --redop sum,avg -b 1K -e 64M -f 16 --ranks "2,$gpus" -q --json "$out/mpi_launch.json" \
          >"$out/mpi_launch.log" 2>&1; then
        note "mpi launch ($gpus processes, all ops/dtypes/redops/placements, 1K..64M): ok, 0 wrong values"
      else
        tail -20 "$out/mpi_launch.log"; note "mpi launch: FAILED (see mpi_launch.log)"
      fi ;;
    launch)
      # keel train and keel bench comm under mpirun, each way a launcher hands out GPUs
      # (device/rank_gpu.h): every GPU visible to every rank, and one GPU per rank (what srun
      # --gpus-per-task 1 gives); refused with one line: two ranks on one GPU, and more ranks than
      # the GPUs they see. The GPUs that held a keel process are sampled with nvidia-smi.
      if [ "$gpus" -lt 2 ]; then note "launch: skipped (needs 2+ GPUs)"; continue; fi
      "$build/keel" data tokenize data/corpus/stories.jsonl --out /tmp/keel-launch/corpus/stories --append-eos \
        --holdout 0.05 --force >"$out/launch_data.log" 2>&1 || { tail -5 "$out/launch_data.log"; note "launch: tokenize FAILED"; continue; }
      tiny=(train configs/train/tiny.yaml --set steps=30 --set log_interval=10 --set checkpoint.final=false --set batch.grad_accum=$gpus
            --set data.datasets.stories=/tmp/keel-launch/corpus/stories --set eval.prefix=/tmp/keel-launch/corpus/stories_heldout)
      comm=(bench comm --backend nccl --op all_reduce,all_to_all -b 1M -e 16M -f 4)
      one_gpu_each=(bash -c 'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec "$0" "$@"')
      # launch_case NAME WANT(ok|fail|timeout) REGEX GPUS_EXPECTED CMD...: the exit status, a line of the log
      # and the number of GPUs that ran a keel process (0: not checked). timeout: exit 124 (keel's
      # watchdog), and only rank 1 (the injected hang) calls itself stuck.
      launch_case() {
        local name=$1 want=$2 re=$3 want_gpus=$4 log="$out/launch_$1.log" seen="$out/launch_$1.gpus"; shift 4
        ( while sleep 0.3; do nvidia-smi --query-compute-apps=gpu_uuid,process_name --format=csv,noheader 2>/dev/null \
            | grep keel | cut -d, -f1; done >"$seen" ) &
        local sampler=$!
        timeout 300 "$@" >"$log" 2>&1; local rc=$?
        kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
        local used; used=$(sort -u "$seen" | grep -c . || true)
        local good=1
        case "$want" in
          ok) [ "$rc" -eq 0 ] || good=0 ;;
          timeout) [ "$rc" -eq 124 ] || good=0; [ "$(grep 'stuck one' "$log" | grep -cv '\[rank 1\] ')" -eq 0 ] || good=0 ;;
          *) { [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; } || good=0 ;;
        esac
        grep -qE "$re" "$log" || good=0
        [ "$want_gpus" -eq 0 ] || [ "$used" -eq "$want_gpus" ] || good=0
        if [ "$good" = 1 ]; then note "launch $name: ok (exit $rc, GPUs used $used)"
        else tail -12 "$log"; note "launch $name: FAILED (exit $rc, GPUs used $used of $want_gpus; see launch_$name.log)"; fi
      }
      mpi=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0)
      rm -rf /tmp/keel-launch/train-*
      launch_case train_all_visible ok 'done: steps 0 -> 30' "$gpus" \
        "${mpi[@]}" -n "$gpus" "$build/keel" "${tiny[@]}" --set output_dir=/tmp/keel-launch/train-all
      launch_case train_one_gpu_each ok 'done: steps 0 -> 30' "$gpus" \
        "${mpi[@]}" -n "$gpus" "${one_gpu_each[@]}" "$build/keel" "${tiny[@]}" --set output_dir=/tmp/keel-launch/train-one
      launch_case comm_all_visible ok 'Wrong values: 0 OK' "$gpus" "${mpi[@]}" -n "$gpus" "$build/keel" "${comm[@]}"
      launch_case comm_one_gpu_each ok 'Wrong values: 0 OK' "$gpus" "${mpi[@]}" -n "$gpus" "${one_gpu_each[@]}" "$build/keel" "${comm[@]}"
      stuck='^keel: error: \[rank 1\] .*this rank is the stuck one'
      launch_case comm_hang_named timeout "$stuck" 0 "${mpi[@]}" -n "$gpus" "$build/keel" "${comm[@]}" --timeout 5 --inject-hang 1
      launch_case comm_hang_at_start_named timeout "$stuck" 0 \
        "${mpi[@]}" -n "$gpus" "$build/keel" "${comm[@]}" --timeout 5 --inject-hang 1 --inject-hang-at start
      launch_case train_hang_named timeout "$stuck" 0 "${mpi[@]}" -n "$gpus" "$build/keel" "${tiny[@]}" \
        --set output_dir=/tmp/keel-launch/train-hang --timeout 10 --inject-hang-rank 1 --inject-hang-step 5
      launch_case train_hang_at_start_named timeout "$stuck" 0 "${mpi[@]}" -n "$gpus" "$build/keel" "${tiny[@]}" \
        --set output_dir=/tmp/keel-launch/train-hang0 --timeout 10 --inject-hang-rank 1 --inject-hang-step 0
      launch_case train_shared_gpu fail '^keel: error: .*would drive the same GPU' 0 \
        env CUDA_VISIBLE_DEVICES=0 "${mpi[@]}" -x CUDA_VISIBLE_DEVICES -n 2 "$build/keel" "${tiny[@]}" --set output_dir=/tmp/keel-launch/train-shared
      launch_case comm_shared_gpu fail '^keel: error: .*would drive the same GPU' 0 \
        env CUDA_VISIBLE_DEVICES=0 "${mpi[@]}" -x CUDA_VISIBLE_DEVICES -n 2 "$build/keel" "${comm[@]}"
      launch_case train_too_few_visible fail '^keel: error: \[rank [0-9]+\] 3 ranks run on host .* each sees 2 GPUs' 0 \
        env CUDA_VISIBLE_DEVICES=0,1 "${mpi[@]}" -x CUDA_VISIBLE_DEVICES -n 3 --oversubscribe "$build/keel" "${tiny[@]}" --set batch.grad_accum=3 --set output_dir=/tmp/keel-launch/train-few
      rm -rf /tmp/keel-launch ;;
    peer)
      if [ "$gpus" -lt 2 ]; then note "peer: skipped (needs 2+ GPUs)"; continue; fi
      # GPU-to-GPU copy-engine bandwidth, every ordered pair, one way and both (N x N matrices).
      if timeout 300 "$build/keel" bench mem --backend cuda --op peer,memcpy,h2d_pinned,d2h_pinned -b 256M -e 256M \
          -n 20 --json "$out/peer.json" >"$out/peer.log" 2>&1; then
        note "peer matrix (256 MiB, GB/s):"; grep -A$((gpus + 1)) 'GB/s at' "$out/peer.log" | head -60 >>"$summary"
      else
        tail -20 "$out/peer.log"; note "peer: FAILED (see peer.log)"
      fi ;;
    memgemm)
      if [ -f bench/mem_gemm_vs_torch.py ]; then
        python3 bench/mem_gemm_vs_torch.py --keel "$build/keel" --out "$out" 2>&1 | tee "$out/mem_gemm_vs_torch.log" | tail -40
        grep -A100 '^== bench mem/gemm vs PyTorch' "$out/mem_gemm_vs_torch.log" >>"$summary"
      fi ;;
    dp)
      if [ "$gpus" -lt 2 ]; then note "dp: skipped (needs 2+ GPUs)"; continue; fi
      # keel train data parallel + ZeRO-1 on GPUs (NCCL): N GPUs against one (and the overlapped
      # step against the classic one), then weak scaling. KEEL_DP_TESTS=0 / KEEL_DP_BENCH=0 skip
      # either half; KEEL_DP_ARGS go to the scaling script (e.g. --classic-gpus 2,4 --no-torch).
      [ "${KEEL_DP_TESTS:-1}" = 0 ] || for n in $(printf '%s\n' 2 "$gpus" | sort -un); do
        mpi_gtest dp "$n" 'DataParallel.*:DataParallelComm.*' "${KEEL_DP_TEST_TIMEOUT:-300}" '^  [a-z0-9_]+(: step 8| on [0-9]+ GPUs)'
      done
      [ "${KEEL_DP_BENCH:-1}" = 0 ] && continue
      scaling=$(seq -s, 1 "$gpus" | tr ',' '\n' | awk '$1==1||$1==2||$1==4||$1==8' | paste -sd,)
      timeout 900 python3 bench/train_dp_scaling.py --keel "$build/keel" --out "$out/dp" --gpus "$scaling" \
          ${KEEL_DP_ARGS:-} 2>&1 | tee "$out/dp_scaling.log" | tail -16
      grep -A9 -E '^== (keel train weak scaling|PyTorch DDP)' "$out/dp_scaling.log" >>"$summary" ;;
    ep)
      if [ "$gpus" -lt 2 ]; then note "ep: skipped (needs 2+ GPUs)"; continue; fi
      # Expert parallelism on GPUs: the op and keel train against one GPU / pure data
      # parallelism at 2 and all GPUs, then weak scaling with EP = every GPU beside pure data
      # parallelism, with a lower lr and router bias balancing in every run (the bench's router
      # collapses onto one expert otherwise; KEEL_EP_ARGS replace the scaling script's arguments,
      # default --no-torch --lr 3e-5 --router-bias-rate 0.05). KEEL_EP_TESTS=0 / KEEL_EP_BENCH=0 skip
      # either half.
      [ "${KEEL_EP_TESTS:-1}" = 0 ] || for n in $(printf '%s\n' 2 "$gpus" | sort -un); do
        mpi_gtest ep "$n" 'ExpertParallelCuda.*' "${KEEL_EP_TEST_TIMEOUT:-300}" '^  [a-z0-9_]+: EP '
      done
      # The resharding chain: N GPUs at EP N -> N/2 at EP N/2 -> 1 GPU against an uninterrupted
      # run (KEEL_EP_CHAIN=0 skips it; KEEL_EP_CHAIN_ARGS="--mid-ep 2" on 8 GPUs is the issue's
      # 8/EP8 -> 4/EP2 -> 1).
      chain=$(printf '%s\n' 8 4 2 | awk -v g="$gpus" '$1<=g' | head -1)
      if [ "${KEEL_EP_CHAIN:-1}" != 0 ]; then
        if timeout 600 python3 bench/train_reshard_chain.py --keel "$build/keel" --out /tmp/keel-chain --gpus "$chain" ${KEEL_EP_CHAIN_ARGS:-} \
            >"$out/reshard_chain.log" 2>&1; then
          note "resharding chain: ok"
        else
          tail -30 "$out/reshard_chain.log"; note "resharding chain: FAILED (see reshard_chain.log)"
        fi
        grep -A14 '^== keel train resharding chain' "$out/reshard_chain.log" >>"$summary"
        rm -rf /tmp/keel-chain
      fi
      [ "${KEEL_EP_BENCH:-1}" = 0 ] && continue
      scaling=$(seq -s, 1 "$gpus" | tr ',' '\n' | awk '$1==1||$1==2||$1==4||$1==8' | paste -sd,)
      timeout 900 python3 bench/train_dp_scaling.py --keel "$build/keel" --out "$out/ep" --gpus "$scaling" \
          --ep-gpus "$scaling" ${KEEL_EP_ARGS:---no-torch --lr 3e-5 --router-bias-rate 0.05} 2>&1 | tee "$out/ep_scaling.log" | tail -16
      grep -A12 -E '^== (keel train weak scaling|PyTorch DDP)' "$out/ep_scaling.log" >>"$summary" ;;
    tp)
      if [ "$gpus" -lt 2 ]; then note "tp: skipped (needs 2+ GPUs)"; continue; fi
      # keel train's tensor parallelism on 2 GPUs (T=2 with and without sequence parallelism,
      # beside DP=2 and EP=2) against PyTorch's tensor-parallel API on the same models and step
      # (bench/train_tp_vs_torch.py: the bench model and the ZAYA1-shaped model; tokens/s, MFU,
      # memory per GPU, routing, and the time over the one-GPU runs). KEEL_TP_ARGS go to the script;
      # both models take about 16 runs: where a call's time is short, split them, e.g.
      # KEEL_TP_ARGS="--models bench" then "--models zaya1" (or --no-one-gpu, --configs ...).
      # The "keel T=2+SP serial" row times backward's re-gathers on the compute stream (what
      # parallel.tensor_overlap saves). On 4 GPUs, --configs keel-tp-dp,keel-tp-dp-classic times
      # TP=2 x DP=2 on the overlapped ZeRO-1 step against the classic one.
      # Routing: forced balance on both sides (KEEL_TP_ROUTING="" for the learned router, which
      # collapses on the script's random tokens).
      timeout "${KEEL_TP_TIMEOUT:-900}" python3 bench/train_tp_vs_torch.py --keel "$build/keel" --out "$out/tp" \
          ${KEEL_TP_ROUTING---forced-balance} ${KEEL_TP_ARGS:-} 2>&1 | tee "$out/tp_vs_torch.log" | tail -30
      if grep -q '^== keel TP vs PyTorch TP' "$out/tp_vs_torch.log"; then
        grep -A40 '^== keel TP vs PyTorch TP' "$out/tp_vs_torch.log" >>"$summary"
      else
        note "tp: FAILED or timed out before the table (see tp_vs_torch.log)"
      fi ;;
    cp)
      if [ "$gpus" -lt 2 ]; then note "cp: skipped (needs 2+ GPUs)"; continue; fi
      # Context parallelism on 2 GPUs: the tests against one GPU (KEEL_CP_TESTS=0 skips), then
      # bench/train_cp.py (KEEL_CP_ARGS, e.g. --longest): the ZAYA1-shaped model at 32K over
      # CP=2 (the k/v all-gather, the ring and heads by all-to-all) against 4K over DP=2, same
      # tokens per GPU, with routing. KEEL_CP_ARGS="--only-peer --forced-balance" (KEEL_CP_TESTS=0):
      # keel's context parallelism beside PyTorch's (context_parallel + DDP, bench/train_cp_torch.py)
      # on the GQA model of the same widths, CP=2 at 32K and DP=2 at 4K on each side.
      [ "${KEEL_CP_TESTS:-1}" = 0 ] || mpi_gtest cp 2 'ContextParallel*' "${KEEL_CP_TEST_TIMEOUT:-300}" '^  [a-z0-9_]+: step 9'
      [ "${KEEL_CP_BENCH:-1}" = 0 ] && continue
      timeout "${KEEL_CP_TIMEOUT:-900}" python3 bench/train_cp.py --keel "$build/keel" --out "$out/cp" \
          --modes allgather,ring,alltoall ${KEEL_CP_ARGS:-} 2>&1 | tee "$out/train_cp.log" | tail -20
      if grep -q '^== keel context parallelism' "$out/train_cp.log"; then
        grep -A20 '^== keel context parallelism' "$out/train_cp.log" >>"$summary"
      else
        note "cp: FAILED or timed out before the table (see train_cp.log)"
      fi ;;
    lasp)
      # LASP-2 against LASP-1 and the all-to-all on 2 GPUs (issue 31): bench/train_cp.py --lasp, every
      # layer linear attention, CP=2 with the states all-gathered, passed rank to rank, or the heads
      # exchanged instead (KEEL_LASP_ARGS).
      if [ "$gpus" -lt 2 ]; then note "lasp: skipped (needs 2+ GPUs)"; continue; fi
      timeout "${KEEL_LASP_TIMEOUT:-900}" python3 bench/train_cp.py --keel "$build/keel" --out "$out/lasp" --lasp \
          --lengths 16384,32768,65536,131072 ${KEEL_LASP_ARGS:-} 2>&1 | tee "$out/train_lasp.log" | tail -14
      if grep -q '^== keel context parallelism, LASP-2 vs LASP-1' "$out/train_lasp.log"; then
        grep -A20 '^== keel context parallelism, LASP-2 vs LASP-1' "$out/train_lasp.log" >>"$summary"
      else
        note "lasp: FAILED or timed out before the table (see train_lasp.log)"
      fi ;;
    tsp)
      # TSP on GPUs: the tests against one GPU (KEEL_TSP_TESTS=0 skips), then bench/tsp_memory.py
      # (KEEL_TSP_ARGS): per-rank memory of TSP=2, TP=2, TP=2+SP, CP=2 and DP=2 at the 7B widths,
      # beside keel size's prediction. With one GPU both ranks share it (KEEL_NCCL_OVER_MPI:
      # collectives through MPI; memory only, nothing timed). The ZAYA1-shaped model instead:
      # KEEL_TSP_ARGS="--model zaya1 --lengths 4096,16384,32768" (forced-balance routing; later
      # --lengths override the 7B's). KEEL_TSP_ARGS may add --profile (each run's step phases),
      # --tsp-tables sweep|gather and --context-mode ring.
      [ "$gpus" -lt 1 ] && { note "tsp: skipped (no GPU)"; continue; }
      [ "$gpus" -lt 2 ] && export KEEL_NCCL_OVER_MPI=1
      [ "${KEEL_TSP_TESTS:-1}" = 0 ] || mpi_gtest tsp 2 'Tsp.Gpu*' "${KEEL_TSP_TEST_TIMEOUT:-300}" '^  [a-z0-9_]+: last step'
      [ "${KEEL_TSP_BENCH:-1}" = 0 ] && { unset KEEL_NCCL_OVER_MPI; continue; }
      # On 2+ GPUs each layout also trains 5 steps: tokens/s per GPU beside the memory.
      tsp_steps=""; [ "$gpus" -ge 2 ] && tsp_steps="--steps 5"
      timeout "${KEEL_TSP_TIMEOUT:-600}" python3 bench/tsp_memory.py --keel "$build/keel" --out "$out/tsp" \
          --device cuda --size --hidden 4096 --lengths 16384,32768,65536,131072 $tsp_steps ${KEEL_TSP_ARGS:-} 2>&1 \
          | tee "$out/tsp_memory.log" | tail -20
      if grep -q '^== keel train per-rank memory' "$out/tsp_memory.log"; then
        grep -A12 '^== keel train per-rank memory' "$out/tsp_memory.log" >>"$summary"
        grep -A8 '^== keel train tokens/s per GPU' "$out/tsp_memory.log" >>"$summary"
      else
        note "tsp: FAILED or timed out before the table (see tsp_memory.log)"
      fi
      unset KEEL_NCCL_OVER_MPI ;;
    compose)
      # The parallel schemes composed on GPUs (TP x DP, TP x DP x EP, TSP x DP, TSP x DP x EP, CP x TP,
      # EP in the classic ZeRO-1 step) against one GPU, at 4 ranks: one per GPU on 4+ GPUs, else
      # sharing the GPUs with NCCL staged through MPI (KEEL_NCCL_OVER_MPI: correctness only,
      # nothing timed). Then every multi-rank GPU test at 2 ranks the same way.
      [ "$gpus" -lt 1 ] && { note "compose: skipped (no GPU)"; continue; }
      [ "$gpus" -lt 4 ] && export KEEL_NCCL_OVER_MPI=1
      mpi_gtest compose 4 'TensorParallel.Gpu*:Tsp.Gpu*:ContextParallel.Gpu*:DataParallel.GpuClassicStep*:DataParallel.GpusMatchOneGpu' \
          "${KEEL_COMPOSE_TIMEOUT:-600}" '^  [a-z0-9_]+: (last step|step 9)|^  classic step with ep'
      [ "$gpus" -lt 2 ] && export KEEL_NCCL_OVER_MPI=1
      [ "$gpus" -ge 2 ] && unset KEEL_NCCL_OVER_MPI
      mpi_gtest compose 2 'TensorParallel.Gpu*:Tsp.Gpu*:ContextParallel.Gpu*:DataParallel.Gpu*' \
          "${KEEL_COMPOSE_TIMEOUT:-600}" '^  [a-z0-9_]+: (last step|step 9)|^  classic step with ep'
      unset KEEL_NCCL_OVER_MPI ;;
    linattn)
      # keel's linear attention kernels against flash-linear-attention's (bench/linear_attention_vs_fla.py;
      # fla-core and einops from .whl/, carried to the GPU machine; KEEL_LINATTN_ARGS to the script).
      timeout "${KEEL_LINATTN_TIMEOUT:-600}" python3 bench/linear_attention_vs_fla.py --keel "$build/keel" \
          ${KEEL_LINATTN_ARGS:-} 2>&1 | tee "$out/linattn_vs_fla.log" | tail -14
      if grep -q '^== keel linear attention vs' "$out/linattn_vs_fla.log"; then
        grep -A10 '^== keel linear attention vs' "$out/linattn_vs_fla.log" >>"$summary"
      else
        note "linattn: FAILED or timed out before the table (see linattn_vs_fla.log)"
      fi ;;
    soak)
      # keel run on every GPU (one rank each) through a killed and a hung rank on the ZAYA1-shaped
      # model (issue 32): detection latency, restart time, steps lost (bench/run_soak.py;
      # KEEL_SOAK_ARGS to it). The hang deadline's floor is keel run's default, 10 s. (The false
      # hangs of the earlier soaks were a loss-spike save waiting on writes with no heartbeat:
      # fixed, PERFORMANCE.md.)
      # keel run is stopped 90 s before KEEL_SOAK_TIMEOUT (run_soak.py --deadline), so a run longer
      # than the call still prints its table.
      # The model's config and data: zaya_model (6,000 rows, more than the soak reads). The run (and
      # its checkpoints, ~25 GB each) lives in /tmp/keel-soak; its logs and events come back in $out/soak.
      zaya_model /tmp/keel-soak/model "$out/soak_model.log"
      timeout "${KEEL_SOAK_TIMEOUT:-540}" python3 bench/run_soak.py --keel "$build/keel" --device cuda \
          --config /tmp/keel-soak/model/keel_train.yaml --own-data --kinds kill,hang --ranks "$gpus" \
          ${KEEL_SOAK_PLAN:---minutes 3.0 --interval 90 --checkpoint-interval 200 --first-fault-step 440} --spike-window 50 --min-deadline 10 \
          --set batch.grad_accum=$gpus --out /tmp/keel-soak/soak --deadline $(( ${KEEL_SOAK_TIMEOUT:-540} - 90 )) \
          --stop-grace 60 ${KEEL_SOAK_ARGS:-} 2>&1 \
          | tee "$out/soak.log" | tail -14
      mkdir -p "$out/soak"
      cp /tmp/keel-soak/soak/soak_result.json /tmp/keel-soak/soak/keel_run.log /tmp/keel-soak/soak/run/run_events.jsonl \
          "$out/soak/" 2>/dev/null
      if grep -q '^kind ' "$out/soak.log"; then
        sed -n '/^keel run exit/,$p' "$out/soak.log" >>"$summary"
      else
        note "soak: FAILED or timed out before the table (see soak.log); its faults so far:"
        grep -E "^keel run: (fault|  at detection)" /tmp/keel-soak/soak/keel_run.log 2>/dev/null | cut -c1-400 \
          | tail -16 >>"$summary"
      fi
      # a timed-out soak leaves keel run and its ranks going: stop them before the next step
      pkill -KILL -f /tmp/keel-soak/ 2>/dev/null && sleep 5
      rm -rf /tmp/keel-soak ;;
    canary)
      # keel run's GPU straggler watch on healthy GPUs (issue 32; docs/fault_tolerance.md, "GPU
      # stragglers"): no fault, the ZAYA1-shaped model on every GPU for KEEL_CANARY_STEPS (400)
      # steps, once with the overlapped ZeRO-1 step and once with the classic one (nothing else
      # runs beside the canary then). Prints each run's straggler events with the canary samples
      # their verdicts read: a rank named in the first run and not in the second points at the
      # overlapped work beside the canary; named in both, at the host's launch delay.
      if [ "$gpus" -lt 2 ]; then note "canary: skipped (needs 2+ GPUs)"; continue; fi
      zaya_model /tmp/keel-canary/model "$out/canary_model.log"
      for overlap in true false; do
        timeout 300 "$build/keel" run /tmp/keel-canary/model/keel_train.yaml --ranks "$gpus" \
            --set steps="${KEEL_CANARY_STEPS:-400}" --set batch.grad_accum="$gpus" --set checkpoint.interval=0 \
            --set checkpoint.final=false --set eval.interval=0 --set log_interval=50 \
            --set parallel.zero1.overlap=$overlap --set output_dir=/tmp/keel-canary/run_$overlap \
            >"$out/canary_overlap_$overlap.log" 2>&1
        rc=$?
        n=$(grep -c '"event":"straggler"' /tmp/keel-canary/run_$overlap/run_events.jsonl 2>/dev/null)
        note "canary, parallel.zero1.overlap $overlap: keel run exit $rc, ${n:-0} straggler report(s)"
        grep '"event":"straggler"' /tmp/keel-canary/run_$overlap/run_events.jsonl 2>/dev/null | cut -c1-400 >>"$summary"
        cp /tmp/keel-canary/run_$overlap/run_events.jsonl "$out/canary_events_$overlap.jsonl" 2>/dev/null
      done
      rm -rf /tmp/keel-canary ;;
    preflight)
      # keel run's pre-flight health gate on every GPU (issue 32; docs/fault_tolerance.md): the tiny
      # config for 20 steps, once on healthy GPUs, once with rank 1's figures cut to a hundredth
      # before attempt 1 (health@1:r1): each GPU's GEMM and memory figures, the all-reduce, the
      # gate's seconds, and the failing GPU's exclusion (the job goes on without it).
      if [ "$gpus" -lt 2 ]; then note "preflight: skipped (needs 2+ GPUs)"; continue; fi
      "$build/keel" data tokenize data/corpus/stories.jsonl --out /tmp/keel-preflight/stories --append-eos \
          --holdout 0.05 --force >"$out/preflight_data.log" 2>&1
      for inject in none health@1:r1; do
        timeout 300 "$build/keel" run configs/train/tiny.yaml --ranks "$gpus" --preflight --set device=cuda \
            --set data.datasets.stories=/tmp/keel-preflight/stories --set eval.prefix=/tmp/keel-preflight/stories_heldout \
            --set steps=20 --set log_interval=10 --set batch.grad_accum="$gpus" \
            --set output_dir="/tmp/keel-preflight/run_${inject%%@*}" $([ "$inject" = none ] || echo --inject "$inject") \
            >"$out/preflight_${inject%%@*}.log" 2>&1
        note "preflight, inject $inject: keel run exit $?"
        grep -E '^keel run: (pre-flight|excluding|done)' "$out/preflight_${inject%%@*}.log" | cut -c1-300 >>"$summary"
        cp "/tmp/keel-preflight/run_${inject%%@*}/run_events.jsonl" "$out/preflight_events_${inject%%@*}.jsonl" 2>/dev/null
      done
      rm -rf /tmp/keel-preflight ;;
    kernels)
      # keel's step kernels (attention, the experts' GEMMs, LM head + cross-entropy) beside PyTorch's on the
      # same shapes (bench/kernels_vs_torch.py; KEEL_KERNELS_ARGS to the script).
      timeout "${KEEL_KERNELS_TIMEOUT:-600}" python3 bench/kernels_vs_torch.py --keel "$build/keel" \
          --json "$out/kernels.json" ${KEEL_KERNELS_ARGS:-} 2>&1 | tee "$out/kernels_vs_torch.log" | grep -v "Warning\|return F" | tail -30
      if grep -q '^== keel kernels vs' "$out/kernels_vs_torch.log"; then
        sed -n '/^== keel kernels vs/,$p' "$out/kernels_vs_torch.log" | grep -E '^==|^--|keel  |cudnn|grouped_mm eager|compiled  ' >>"$summary"
      else
        note "kernels: FAILED or timed out before the table (see kernels_vs_torch.log)"
      fi ;;
    train)
      # keel train vs a PyTorch implementation of the same MoE and step (eager and torch.compile).
      timeout 900 python3 bench/train_vs_torch.py --keel "$build/keel" --out "$out/train" ${KEEL_TRAIN_ARGS:-} 2>&1 \
        | tee "$out/train_vs_torch.log" | tail -20
      grep -A12 '^== keel train vs PyTorch' "$out/train_vs_torch.log" >>"$summary" ;;
    routing)
      # Routing health on the ZAYA1-shaped model, real text: the old router init vs keel train's
      # defaults (busiest class / fair share, skip share, loss, tokens/s); KEEL_ROUTING_ARGS to the script.
      timeout 900 python3 bench/routing_health.py --keel "$build/keel" --out "$out/routing" ${KEEL_ROUTING_ARGS:-} 2>&1 \
        | tee "$out/routing_health.log" | tail -8
      grep -A6 '^== routing health' "$out/routing_health.log" >>"$summary" ;;
    ckpt)
      # keel checkpoints vs torch.distributed.checkpoint on the same state size, all GPUs; the
      # checkpoints go to KEEL_CKPT_DIR (local disk, not $OUT), the logs and JSON to $OUT;
      # KEEL_CKPT_ARGS go to the script (e.g. --layers 32 --ep: 7.3 B parameters). Where both
      # sides together outlast one call, split it: "--part keel" first (its keel_result.json comes
      # back under $OUT/ckpt), then "--part dcp --keel-result FILE" with that file in the tree.
      ckdir=${KEEL_CKPT_DIR:-/tmp/keel-ckpt-bench}
      timeout 900 python3 bench/ckpt_vs_dcp.py --keel "$build/keel" --out "$ckdir" --gpus "$gpus" ${KEEL_CKPT_ARGS:-} 2>&1 \
        | tee "$out/ckpt_vs_dcp.log" | tail -12
      mkdir -p "$out/ckpt" && cp "$ckdir"/*.log "$ckdir"/*.json "$out/ckpt/" 2>/dev/null
      rm -rf "$ckdir"
      grep -A9 '^== keel checkpoints' "$out/ckpt_vs_dcp.log" >>"$summary" ;;
    decode)
      # keel generate's per-token latency at batch 1, 8, 64 on ZAYA1-8B's widths: the first
      # KEEL_DECODE_LAYERS (8) of its 40 layers, freshly initialized (no released weights here).
      layers=${KEEL_DECODE_LAYERS:-8}
      sed "s/^layers: .*/layers: $layers/; s/^name: .*/name: zaya1-8b-cut$layers/" configs/zaya1-8b.yaml >"$out/zaya1-8b-cut.yaml"
      timeout 600 "$build/keel" generate --model "$out/zaya1-8b-cut.yaml" -p "Once upon a time" --max-new-tokens 128 \
          --batch 1,8,64 --bench --device cuda 2>&1 | tee "$out/decode.log" | tail -8
      { echo "decode (ZAYA1-8B widths, $layers layers, 128 new tokens):"; grep -E '^ +(batch|1|8|64) ' "$out/decode.log"; } >>"$summary" ;;
    ab)
      # Throughput before and after a change: KEEL_AB_BASE (default baseline/, a source tree of
      # the earlier commit, e.g. `git archive COMMIT | tar -x -C baseline`) is built (target keel
      # only, into its build-gpu/) and bench/engine_ab.py trains the same runs with both binaries,
      # alternately; KEEL_AB_ARGS go to the script (default --cases zaya1,bench,dp2 --runs 3).
      base=${KEEL_AB_BASE:-baseline}
      if [ ! -f "$base/CMakeLists.txt" ]; then note "ab: skipped (no source tree at $base)"; continue; fi
      start=$(date +%s)
      gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
      if cmake -S "$base" -B "$base/build-gpu" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
          >"$out/ab_build.log" 2>&1 && cmake --build "$base/build-gpu" --target keel >>"$out/ab_build.log" 2>&1; then
        note "ab: baseline built ($(( $(date +%s) - start )) s)"
      else
        tail -20 "$out/ab_build.log"; note "ab: baseline build FAILED (see ab_build.log)"; continue
      fi
      timeout 900 python3 bench/engine_ab.py --a "$base/build-gpu/keel" --b "$build/keel" --out /tmp/keel-ab \
          ${KEEL_AB_ARGS:---cases zaya1,bench,dp2 --runs 3} 2>&1 | tee "$out/engine_ab.log" | tail -8
      cp /tmp/keel-ab/engine_ab.json "$out/" 2>/dev/null
      grep -A5 '^== keel A (baseline)' "$out/engine_ab.log" >>"$summary" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo
echo "================ summary ================"
cat "$summary"
# The device tool returns at most 8 files: pack everything into one archive beside the summary.
if [ -n "${OUT:-}" ]; then
  tar czf /tmp/keel_results.tgz -C "$out" . && find "$out" -type f ! -name summary.txt -delete && mv /tmp/keel_results.tgz "$out/results.tgz"
fi
