#!/usr/bin/env python3
"""keel train's hooks for a supervisor (docs/train.md "Fault injection, heartbeats, skipped data").

  check_train_faults.py heartbeat KEEL STORIES_PREFIX OUT_DIR [MPIEXEC ARGS...]
    --heartbeat DIR: after a run, every rank's DIR/rank-<r>.json says phase "done" at the last
    step (2 ranks under MPIEXEC when given); a run that exits at the start of step 1 leaves
    phase "start" at step 0, one that exits at the start of step 3 phase "step" at step 2, and
    a run resumed at step 2 that exits at once phase "start" at step 2.
  check_train_faults.py skip KEEL STORIES_PREFIX OUT_DIR
    --skip-step 3: the losses match a plain run's at steps 1-2 and differ from step 3 on; a run
    resumed from a checkpoint saved after step 3 of a skip run, given --skip-step 3 again,
    continues exactly as the uninterrupted skip run (the skip is not applied twice), and one
    resumed from step 2 applies it (and matches too).
"""
import json
import os
import shutil
import subprocess
import sys
import time

STEPS = 6


def train(keel, stories, out, *extra, launcher=(), expect=0, fresh=True):
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    cmd = [*launcher, keel, "train", os.path.join(src, "configs/train/tiny.yaml"), "--set", "device=cpu",
           "--set", f"data.datasets.stories={stories}", "--set", f"steps={STEPS}", "--set", "log_interval=1",
           "--set", "schedule.warmup_steps=2", "--set", "data.seq_length=64", "--set", "batch.micro_batch=4",
           "--set", f"eval.prefix={stories}_heldout", "--set", "eval.interval=0", "--set", f"output_dir={out}",
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != expect:
        sys.exit(f"{' '.join(cmd)}\nexited {r.returncode}, expected {expect}:\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def losses(out):
    """step -> (loss, ce, grad_norm), the last line of each step (a resumed run appends)."""
    rows = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        row = json.loads(line)
        if "loss" in row:
            rows[row["step"]] = (row["loss"], row["ce"], row["grad_norm"])
    return rows


def heartbeat_of(hb, rank):
    path = os.path.join(hb, f"rank-{rank}.json")
    with open(path) as f:
        return json.load(f), path


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


def heartbeat(keel, stories, out, launcher):
    keys = ["rank", "step", "time", "step_seconds", "wait_seconds", "device_seconds", "phase", "host", "pid", "world"]
    world = 2 if launcher else 1
    hb = out + "_hb"
    shutil.rmtree(hb, ignore_errors=True)
    began = time.time()
    extra = ["--set", "batch.grad_accum=2"] if launcher else []
    train(keel, stories, out, "--set", "checkpoint.final=false", "--heartbeat", hb, *extra, launcher=launcher)
    for r in range(world):
        j, path = heartbeat_of(hb, r)
        print(f"{path}: {json.dumps(j)}")
        check(list(j) == keys, f"{path}: keys {list(j)}, expected {keys}")
        check(j["rank"] == r and j["world"] == world, f"{path}: rank/world {j['rank']}/{j['world']}")
        check(0 <= j["wait_seconds"] <= j["step_seconds"], f"{path}: waited {j['wait_seconds']} s of a {j['step_seconds']} s step")
        check(j["device_seconds"] == 0, f"{path}: a device canary on CPU ranks ({j['device_seconds']} s)")
        check(j["phase"] == "done" and j["step"] == STEPS, f"{path}: phase {j['phase']} at step {j['step']}")
        check(began - 1 <= j["time"] <= time.time() + 1, f"{path}: time {j['time']} is not now")
        check(j["step_seconds"] > 0, f"{path}: step_seconds {j['step_seconds']}")
        check(isinstance(j["pid"], int) and j["pid"] > 0 and isinstance(j["host"], str) and j["host"],
              f"{path}: pid/host")
    check(sorted(os.listdir(hb)) == [f"rank-{r}.json" for r in range(world)], f"{hb} holds {os.listdir(hb)}")
    if launcher:
        return
    # where a run died, the heartbeat says how far it got
    for at, phase, step in ((1, "start", 0), (3, "step", 2)):
        shutil.rmtree(hb, ignore_errors=True)
        o = train(keel, stories, out, "--set", "checkpoint.final=false", "--heartbeat", hb, "--inject", f"exit@{at}",
                  expect=3)
        check(f"keel: fault injection: rank 0 exits with code 3 at step {at}" in o, "no injection line")
        j, path = heartbeat_of(hb, 0)
        print(f"exit@{at}: {json.dumps(j)}")
        check(j["phase"] == phase and j["step"] == step, f"exit@{at}: {path} says {j['phase']} at step {j['step']}")
        check(j["step_seconds"] == 0 if phase == "start" else j["step_seconds"] > 0, f"exit@{at}: step_seconds")
    # a resumed run starts at its checkpoint's step
    train(keel, stories, out, "--set", "checkpoint.interval=2", "--stop-after", "2")
    shutil.rmtree(hb, ignore_errors=True)
    train(keel, stories, out, "--resume", out, "--heartbeat", hb, "--inject", "exit@3", expect=3, fresh=False)
    j, path = heartbeat_of(hb, 0)
    print(f"resumed, exit@3: {json.dumps(j)}")
    check(j["phase"] == "start" and j["step"] == 2, f"resumed: {path} says {j['phase']} at step {j['step']}")


def skip(keel, stories, out):
    plain, skipped = out + "_plain", out + "_skip"
    train(keel, stories, plain, "--set", "checkpoint.final=false")
    o = train(keel, stories, skipped, "--set", "checkpoint.final=false", "--skip-step", "3")
    check(o.count("keel train: skipping the data of step 3") == 1, "the skip run did not say it skips step 3 once")
    a, b = losses(plain), losses(skipped)
    check(sorted(a) == sorted(b) == list(range(1, STEPS + 1)), f"steps logged: {sorted(a)} and {sorted(b)}")
    for s in range(1, STEPS + 1):
        print(f"step {s}: loss {a[s][0]:.6f} plain, {b[s][0]:.6f} with --skip-step 3")
    check(all(a[s] == b[s] for s in (1, 2)), "steps 1-2 differ with --skip-step 3")
    check(all(a[s][0] != b[s][0] for s in range(3, STEPS + 1)), "a step from 3 on matches the plain run")
    # resumed after the skip (step 4, saved after step 3 ran on skipped data), --skip-step 3 again
    for stop in (4, 2):
        part = f"{out}_resume{stop}"
        train(keel, stories, part, "--set", f"checkpoint.interval={stop}", "--stop-after", str(stop),
              "--skip-step", "3")
        o = train(keel, stories, part, "--set", "checkpoint.final=false", "--resume", part, "--skip-step", "3",
                  fresh=False)
        said = "keel train: skipping the data of step 3" in o
        check(said == (stop < 3), f"resumed at step {stop}: the skip was {'' if said else 'not '}applied")
        c = losses(part)
        for s in range(1, STEPS + 1):
            check(c.get(s) == b[s], f"resumed at step {stop}: step {s} is {c.get(s)}, the skip run's {b[s]}")
        print(f"resumed at step {stop} with --skip-step 3: steps 1-{STEPS} match the skip run "
              f"(skip {'applied' if said else 'not applied again'})")


def main():
    what, keel, stories, out = sys.argv[1:5]
    stories = os.path.abspath(stories)
    if what == "heartbeat":
        heartbeat(keel, stories, out, sys.argv[5:])
    elif what == "skip":
        skip(keel, stories, out)
    else:
        sys.exit(f"unknown check {what}")
    print("ok")


if __name__ == "__main__":
    main()
