#!/usr/bin/env python3
"""Reads the event file keel's MetricsLog wrote (MetricsLog.WritesEventFileForTensorBoard) with
the real tensorboard package and checks every step and value, the NaN that must be left out,
and the config text summary. Usage: check_tensorboard.py DIR. Fails (exit 1) when the
tensorboard package is missing: scripts/setup.sh installs it."""
import math
import os
import sys

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    sys.exit(f"check_tensorboard: FAIL: the Python package 'tensorboard' is not installed ({e}); "
             "run scripts/setup.sh --deps-only or: python3 -m pip install tensorboard")


def fail(msg):
    sys.exit(f"check_tensorboard: FAIL: {msg}")


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def main():
    d = sys.argv[1]
    files = [f for f in os.listdir(d) if f.startswith("events.out.tfevents.")]
    if len(files) != 1:
        fail(f"expected one event file in {d}, found {files}")
    acc = EventAccumulator(d, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    if acc.file_version != 2.0:
        fail(f"file_version {acc.file_version!r}, expected 2.0 (brain.Event:2)")
    tags = acc.Tags()
    expected = {
        "loss": lambda s: 10.0 - 0.5 * s,
        "lr": lambda s: 1e-4 * (s + 1),
        "grad_norm": lambda s: 1.0 / (s + 1),
        "tokens_per_s": lambda s: 12345.0 + s,
        "mfu": lambda s: 0.25,
        "mem_gib": lambda s: 3.5,
        "expert_load/max": lambda s: 1.5,
    }
    if sorted(tags["scalars"]) != sorted(expected):
        fail(f"scalar tags {sorted(tags['scalars'])}, expected {sorted(expected)}")
    for tag, f in expected.items():
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        want_steps = [0, 1, 3, 4] if tag == "grad_norm" else [0, 1, 2, 3, 4]  # NaN at step 2 left out
        if steps != want_steps:
            fail(f"{tag}: steps {steps}, expected {want_steps}")
        for e in events:
            if not close(e.value, f(e.step)):  # values are float32 in the event file
                fail(f"{tag} at step {e.step}: {e.value}, expected {f(e.step)}")
            if e.wall_time < 1.6e9:
                fail(f"{tag} at step {e.step}: wall_time {e.wall_time}")
    if "config" not in tags["tensors"]:
        fail(f"no 'config' text summary among tensors {tags['tensors']}")
    (config,) = acc.Tensors("config")
    text = config.tensor_proto.string_val[0].decode()
    if config.step != 0 or text != "model: tiny\nsteps: 5":
        fail(f"config text at step {config.step}: {text!r}")
    meta = acc.SummaryMetadata("config")
    if meta.plugin_data.plugin_name != "text":
        fail(f"config plugin {meta.plugin_data.plugin_name!r}, expected 'text'")
    print(f"check_tensorboard: OK: tensorboard read {files[0]}: {len(expected)} scalar tags x 5 steps "
          "(one NaN left out) and the config text")


if __name__ == "__main__":
    main()
