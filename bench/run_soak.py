#!/usr/bin/env python3
"""keel run's soak (issue 32): faults of every kind at random, on CPU ranks or GPUs.

`keel run` trains configs/train/tiny.yaml (device cpu, --ranks 2, the global batch of the config:
micro_batch 4 x grad_accum 2 over the two ranks) for about --minutes of wall time, with faults
injected through keel train's --inject (common/faults.h) at random steps: --minutes x 60 /
--interval of them (a fault every --interval seconds of wall time on average), placed as a
Poisson process with that count places them (at least a checkpoint interval + 5 steps apart). The
run is sized so that it would end after about --minutes at --expect-ratio effective training
time, with the step time measured by a short fault-free run first (--step-seconds skips that).
Every kind comes up equally often (the kinds are drawn in shuffled rounds): kill, exit, hang,
slow (a straggler: 10 steps 300 ms slower), nan, spike (the loss x 100; the loss-spike guard is
on, --spike-sigma over --spike-window steps) and diskfull (at the next checkpoint step), each on
a random rank. keel run's settings: --backoff, --backoff-max, --min-deadline and --max-restarts
below (its defaults are for a job that should not crash often: a back-off doubling to 30 s, a
10 s hang floor, 10 restarts).

Reported, from keel run's files (OUT/run_events.jsonl, OUT/run_attempt_N.log): for each kind the
faults planned, fired (their "keel: fault injection" lines), detected (a fault event of the
attempt they fired in, with the kind keel run gave it), recovered (a restart after it, and the run
ended done), detection latency (the fault events' detect_seconds: the deadline's wait for a hang,
one poll for the others) and the steps lost (the restart events' steps_lost); fault events with no
injected fault behind them (a real one, or a false spike); the restart time (keel run's fault event
to the first step the next attempt finishes: back-off, start-up, the checkpoint's load and that
step; every step is logged, log_interval 1); and keel run's `done` event: wall time, attempts,
effective_ratio (seconds of the steps kept over the wall time). Beside the restart time, its
parts from keel run's own events: the checksum check of the checkpoint it resumes from
("verified") and the next attempt's launch to its first step ("first_step": start-up, the load
and one step). --deadline S stops keel run (SIGTERM: the job saves and exits) S seconds after this
script started, so that a run longer than its time still prints its table: a fault counts as
recovered there when the attempt after it finished a step. Writes OUT/soak_result.json; the
table comes last.

  python3 bench/run_soak.py --keel build/keel --minutes 10 --out out/soak

On GPUs (issue 32's 2-GPU benchmark: a killed and a hung rank on the ZAYA1-shaped model), with a
train config of that model and its own data (bench/zaya_vs_torch.py writes one):

  python3 bench/run_soak.py --keel build-gpu/keel --device cuda --config OUT/keel_train.yaml --own-data \
      --kinds kill,hang --minutes 3.0 --interval 90 --checkpoint-interval 200 --first-fault-step 440 \
      --spike-window 50 --min-deadline 10 --set batch.grad_accum=2 --out out/soak_gpu

(scripts/gpu.sh soak runs this on every GPU of the machine; the faults come after the first
25 GB checkpoint is committed, and keel run's own 10 s hang floor is kept.)
"""
import argparse
import collections
import json
import math
import os
import random
import re
import shutil
import statistics
import signal
import subprocess
import sys
import time

STARTED = time.time()

KINDS = ["kill", "exit", "hang", "slow", "nan", "spike", "diskfull"]
# the fault kind keel run records for each injected kind (slow: none, it is no fault it detects)
DETECTED_AS = {"kill": "dead", "exit": "dead", "hang": "hang", "slow": None, "nan": "nan", "spike": "loss_spike",
               "diskfull": "disk_full"}
FIRED = [
    ("kill", re.compile(r"keel: fault injection: rank (\d+) killed at step (\d+)")),
    ("exit", re.compile(r"keel: fault injection: rank (\d+) exits with code \d+ at step (\d+)")),
    ("hang", re.compile(r"keel: fault injection: rank (\d+) hangs at step (\d+)")),
    ("slow", re.compile(r"keel: fault injection: rank (\d+) sleeps \d+ ms at step (\d+)")),
    ("nan", re.compile(r"keel: fault injection: rank (\d+)'s loss is NaN at step (\d+)")),
    ("spike", re.compile(r"keel: fault injection: rank (\d+)'s loss is multiplied by \S+ at step (\d+)")),
    ("diskfull", re.compile(r"keel: fault injection: rank (\d+) finds the disk full saving step (\d+)")),
]


def mpi_env():
    env = dict(os.environ)
    for k, v in [("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
                 ("OMPI_MCA_rmaps_base_oversubscribe", "1")]:
        env.setdefault(k, v)
    return env


def train_sets(a, prefix, out, steps):
    # log_interval 1: every step's time lands in metrics.jsonl (the restart timing reads it)
    sets = [f"device={a.device}", "eval.interval=0", f"steps={steps}", "log_interval=1",
            f"checkpoint.interval={a.checkpoint_interval}", "checkpoint.keep_last=3", f"output_dir={out}",
            f"fault.loss_spike_sigma={a.spike_sigma}", f"fault.loss_spike_window={a.spike_window}"]
    if not a.own_data:
        sets += [f"data.datasets.stories={prefix}", f"eval.prefix={prefix}_heldout", "batch.micro_batch=4",
                 f"batch.grad_accum={a.ranks}"]
    sets += a.sets
    return [x for s in sets for x in ("--set", s)]


def measure_step_seconds(a, prefix):
    """The median step time of a short fault-free keel train with the soak's settings."""
    out = os.path.join(a.out, "measure")
    shutil.rmtree(out, ignore_errors=True)
    args = [a.mpirun, "-np", str(a.ranks), "--oversubscribe", "--bind-to", "none", a.keel, "train", a.config,
            *train_sets(a, prefix, out, 40), "--set", "log_interval=1", "--set", "checkpoint.final=false"]
    r = subprocess.run(args, capture_output=True, text=True, env=mpi_env(), timeout=600)
    if r.returncode != 0:
        sys.exit(f"the measuring run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    times = [r["time"] for r in rows if "loss" in r]
    return statistics.median(b - t for t, b in zip(times[5:], times[6:]))  # after warm-up


def plan_faults(a, steps, step_s):
    """[(kind, step, spec)]: --minutes * 60 / --interval faults (the count a Poisson process of that
    mean gap has on average), at the steps of one conditioned on that count (uniform order
    statistics: exponential gaps scaled to the span), at least a checkpoint interval + 5 steps
    apart (one fault per attempt), none before the spike guard's window is full (nor before
    --first-fault-step: on GPUs, after the first checkpoint's commit, so that no fault restarts the
    run from its start); kinds in shuffled rounds, each on a random rank."""
    rng = random.Random(a.seed)
    kinds = a.kinds.split(",")
    count = max(1, round(a.minutes * 60 / a.interval))
    min_gap = a.checkpoint_interval + 5
    # the steps faults may fall on: after the loss-spike guard's window has filled
    first, last = max(a.spike_window + 10, a.first_fault_step), steps - 2 * a.checkpoint_interval
    span = last - first - count * min_gap
    while span < 0 and count > 1:  # fewer faults rather than none: the run is measured anyway
        print(f"{count} faults {min_gap} steps apart do not fit in steps {first}-{last} of {steps}: "
              f"planning {count - 1}", flush=True)
        count -= 1
        span = last - first - count * min_gap
    if span < 0:
        sys.exit(f"{count} fault {min_gap} steps from the end does not fit in steps {first}-{last} of {steps}: "
                 f"a longer run (--minutes) or an earlier --first-fault-step")
    gaps = [rng.expovariate(1.0) for _ in range(count + 1)]
    scale = span / sum(gaps)
    out, step, bag = [], first, []
    for g in gaps[:count]:
        step += min_gap + int(g * scale)
        if not bag:
            bag = kinds[:]
            rng.shuffle(bag)
        kind = bag.pop()
        at = step
        if kind == "diskfull":  # at a checkpoint step
            at = int(math.ceil(step / a.checkpoint_interval)) * a.checkpoint_interval
        rank = rng.randrange(a.ranks)
        spec = {"kill": f"kill@{at}:r{rank}", "exit": f"exit@{at}:r{rank}", "hang": f"hang@{at}:r{rank}",
                "slow": f"slow@{at}-{at + 9}:r{rank}:300", "nan": f"nan@{at}:r{rank}",
                "spike": f"spike@{at}:r{rank}", "diskfull": f"diskfull@{at}:r{rank}"}[kind]
        out.append((kind, at, spec))
        step = at
    return out


def fired_faults(out):
    """{attempt: [(kind, step)]} from the attempts' logs (a slow range counted once)."""
    fired = {}
    n = 1
    while os.path.exists(os.path.join(out, f"run_attempt_{n}.log")):
        seen = []
        for line in open(os.path.join(out, f"run_attempt_{n}.log"), errors="replace"):
            for kind, rx in FIRED:
                m = rx.search(line)
                if m:
                    seen.append((kind, int(m.group(2))))
        slow = sorted(s for k, s in seen if k == "slow")
        firsts = [s for i, s in enumerate(slow) if i == 0 or s != slow[i - 1] + 1]
        fired[n] = [(k, s) for k, s in seen if k != "slow"] + [("slow", s) for s in firsts]
        n += 1
    return fired


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--config", default="configs/train/tiny.yaml")
    ap.add_argument("--data", default="out/corpus/stories",
                    help="token dataset prefix (with PREFIX_heldout); made from data/corpus/stories.jsonl if missing")
    ap.add_argument("--out", default="out/soak")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall time the run is sized for")
    ap.add_argument("--interval", type=float, default=30.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--checkpoint-interval", type=int, default=10, help="steps")
    ap.add_argument("--step-seconds", type=float, default=0, help="skip the measuring run (0: measure)")
    ap.add_argument("--expect-ratio", type=float, default=0.85, help="effective ratio the run is sized with")
    ap.add_argument("--spike-sigma", type=float, default=8.0)
    ap.add_argument("--spike-window", type=int, default=50)
    ap.add_argument("--first-fault-step", type=int, default=0,
                    help="no fault before this step (e.g. after the first checkpoint's commit: a 25 GB save takes "
                         "~250 steps of the ZAYA1-shaped model on an H200 machine's disk)")
    ap.add_argument("--max-restarts", type=int, default=1000)
    ap.add_argument("--backoff", type=float, default=0.5)
    ap.add_argument("--backoff-max", type=float, default=1.0)
    ap.add_argument("--min-deadline", type=float, default=5.0, help="keel run --min-deadline (hang detection floor)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: one rank per GPU (keel run's --ranks GPUs of this machine)")
    ap.add_argument("--own-data", action="store_true",
                    help="train on --config's own datasets and batch (else the story corpus, micro-batch 4)")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="a keel train override (repeatable)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds after this script's start to stop keel run (SIGTERM) and print what ran (0: none)")
    ap.add_argument("--stop-grace", type=float, default=60, help="seconds keel run gets to stop after --deadline")
    a = ap.parse_args()
    for k in a.kinds.split(","):
        if k not in KINDS:
            sys.exit(f"--kinds: unknown kind '{k}' ({', '.join(KINDS)})")
    os.makedirs(a.out, exist_ok=True)
    prefix = a.data
    if not a.own_data and not os.path.exists(prefix + ".idx"):
        prefix = os.path.join(a.out, "stories")
        subprocess.run([a.keel, "data", "tokenize", "data/corpus/stories.jsonl", "--out", prefix, "--append-eos",
                        "--holdout", "0.05", "--force"], check=True, capture_output=True)
    step_s = a.step_seconds or measure_step_seconds(a, prefix)
    wall = a.minutes * 60
    steps = int(wall * a.expect_ratio / step_s)
    faults = plan_faults(a, steps, step_s)
    print(f"step time {step_s:.3f} s: {steps} steps for {a.minutes:g} min at {a.expect_ratio:.0%}; {len(faults)} faults "
          f"(one per {a.interval:g} s of wall time on average, seed {a.seed})", flush=True)
    for kind, at, spec in faults:
        print(f"  {spec}")

    run_out = os.path.join(a.out, "run")
    shutil.rmtree(run_out, ignore_errors=True)
    args = [a.keel, "run", a.config, "--ranks", str(a.ranks), "--max-restarts", str(a.max_restarts), "--backoff",
            str(a.backoff), "--backoff-max", str(a.backoff_max), "--min-deadline", str(a.min_deadline),
            *train_sets(a, prefix, run_out, steps)]
    for _, _, spec in faults:
        args += ["--inject", spec]
    t0 = time.time()
    stopped = False  # by --deadline
    with open(os.path.join(a.out, "keel_run.log"), "w") as log:
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=mpi_env(), start_new_session=True)
        limit = wall * 4 + 600
        if a.deadline > 0:
            limit = min(limit, max(1.0, a.deadline - (t0 - STARTED)))
        try:
            p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stopped = True
            p.send_signal(signal.SIGTERM)  # keel run: the job saves at its next step and exits
            try:
                p.wait(timeout=a.stop_grace)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    elapsed = time.time() - t0
    if stopped:
        print(f"keel run stopped at --deadline ({a.deadline:g} s after this script started): the table holds what ran",
              flush=True)
    for line in open(os.path.join(a.out, "keel_run.log"), errors="replace"):
        if line.startswith("keel run:") or line.startswith("keel: error: run"):
            print("  " + line.rstrip())

    events = [json.loads(l) for l in open(os.path.join(run_out, "run_events.jsonl"))]
    done = next((e for e in events if e["event"] == "done"), None)
    fault_ev = {e["attempt"]: e for e in events if e["event"] == "fault"}
    restart_ev = {e["attempt"]: e for e in events if e["event"] == "restart"}  # keyed by the new attempt
    first_ev = {e["attempt"]: e for e in events if e["event"] == "first_step"}
    verify_ev, attempt_now = {}, 1  # a checkpoint's check before an attempt: after the restart event naming it
    for e in events:
        if e["event"] == "restart":
            attempt_now = e["attempt"]
        elif e["event"] == "verified":
            verify_ev[attempt_now] = e
    fired = fired_faults(run_out)
    rows = collections.OrderedDict((k, {"planned": 0, "fired": 0, "detected": 0, "recovered": 0, "latency": [],
                                        "lost": [], "restart": [], "verify": [], "first_step": []})
                               for k in a.kinds.split(","))
    # every step's wall-clock time (log_interval 1), for the time from a fault's event to the
    # first step the next attempt finishes
    step_times = sorted(r["time"] for r in (json.loads(l) for l in open(os.path.join(run_out, "metrics.jsonl")))
                        if "loss" in r and "time" in r)
    for kind, _, _ in faults:
        rows[kind]["planned"] += 1
    provoked = set()
    mismatched = []
    for attempt, fs in fired.items():
        for kind, step in fs:
            r = rows[kind]
            r["fired"] += 1
            if kind == "slow":  # no fault to detect: recovered when the run went on
                r["recovered"] += 1 if done else 0
                continue
            ev = fault_ev.get(attempt)
            if ev is None:
                continue
            provoked.add(attempt)
            if ev["kind"] != DETECTED_AS[kind]:
                mismatched.append(f"{kind}@{step} detected as {ev['kind']}")
                continue
            r["detected"] += 1
            r["latency"].append(ev["detect_seconds"])
            rs = restart_ev.get(attempt + 1)
            if rs is not None:
                r["lost"].append(rs["steps_lost"])
                after = [t for t in step_times if t > rs["time"]]
                if after:  # back-off, start-up (launch, devices, the checkpoint's load) and one step
                    r["restart"].append(after[0] - ev["time"])
                if attempt + 1 in verify_ev:
                    r["verify"].append(verify_ev[attempt + 1]["seconds"])
                if attempt + 1 in first_ev:
                    r["first_step"].append(first_ev[attempt + 1]["seconds"])
                if done or (stopped and attempt + 1 in first_ev):
                    r["recovered"] += 1
    unprovoked = [f"attempt {n}: {e['kind']} at step {e['reached']}: {e['detail']}" for n, e in fault_ev.items()
                  if n not in provoked]
    result = {"step_seconds": step_s, "steps": steps, "minutes": a.minutes, "interval_s": a.interval, "seed": a.seed,
              "checkpoint_interval": a.checkpoint_interval, "faults": [s for _, _, s in faults], "exit": p.returncode,
              "elapsed_s": elapsed, "done": done, "stopped_at_deadline": stopped, "by_kind": rows,
              "mismatched": mismatched, "unprovoked": unprovoked}
    with open(os.path.join(a.out, "soak_result.json"), "w") as f:
        json.dump(result, f, indent=1)

    if mismatched:
        print("faults detected as another kind: " + "; ".join(mismatched))
    if unprovoked:
        print("fault events with no injected fault behind them: " + "; ".join(unprovoked))
    fired_n = sum(r["fired"] for r in rows.values())
    recovered_n = sum(r["recovered"] for r in rows.values())
    print(f"\nkeel run exit {p.returncode} after {elapsed:.0f} s; {fired_n} faults fired of {len(faults)} planned "
          f"(one per {elapsed / max(fired_n, 1):.1f} s), {recovered_n} recovered ({100.0 * recovered_n / max(fired_n, 1):.0f}%); "
          f"{len(unprovoked)} fault event(s) with no injected fault behind them"
          + (" (" + ", ".join(u.split(":")[1].strip() for u in unprovoked) + ")" if unprovoked else ""))
    if done:
        print(f"done: {done['steps']} steps, {done['attempts']} attempts, wall {done['wall_seconds']:.0f} s, steps kept "
              f"{done['step_seconds_kept']:.0f} s: effective_ratio {done['effective_ratio']:.3f}; steps lost in all "
              f"{sum(e['steps_lost'] for e in restart_ev.values())}")
    print(f"\n{'kind':<9} {'planned':>7} {'fired':>5} {'detected':>8} {'recovered':>9} {'detect s mean':>13} "
          f"{'detect s max':>12} {'restart s mean':>14} {'verify s':>8} {'launch s':>8} {'steps lost':>10}")
    for kind, r in rows.items():
        lat = r["latency"]
        mean = f"{statistics.mean(lat):.2f}" if lat else "-"
        mx = f"{max(lat):.2f}" if lat else "-"
        rst = f"{statistics.mean(r['restart']):.2f}" if r["restart"] else "-"
        det = "n/a" if kind == "slow" else str(r["detected"])
        ver = f"{statistics.mean(r['verify']):.2f}" if r["verify"] else "-"
        fst = f"{statistics.mean(r['first_step']):.2f}" if r["first_step"] else "-"
        print(f"{kind:<9} {r['planned']:>7} {r['fired']:>5} {det:>8} {r['recovered']:>9} {mean:>13} {mx:>12} "
              f"{rst:>14} {ver:>8} {fst:>8} {sum(r['lost']):>10}")
    print("detect s: the fault to keel run's verdict; restart s: keel run's fault event to the first step the "
          "next attempt finishes (back-off, start-up and that step); of it, verify s: the checksums of the "
          "checkpoint resumed from, and launch s: the next attempt's launch to its first step")
    return 0 if (done or stopped) and recovered_n == fired_n and not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
