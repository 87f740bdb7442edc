#!/usr/bin/env python3
"""The floors of src/ (docs/architecture.md): which module may include which.

Reads every #include "module/..." in src/ and fails, naming the file and line, on an include of a
module the including module may not use, and on any cycle between modules. Run by CTest
(tests/CMakeLists.txt) as `floors`.
"""
import os
import re
import sys

# Each module and the modules it may include (besides itself). A module may include anything a
# module it may include may include only when listed here too: the floors are explicit.
ALLOWED = {
    "common": set(),
    "tensor": {"common"},
    "device": {"common"},
    "hw": {"common"},
    "data": {"common"},
    "mesh": {"common"},
    "optim": {"common", "mesh"},
    "model": {"common", "mesh", "optim"},
    "ops": {"common", "device", "optim", "tensor"},
    "blocks": {"common", "device", "model", "ops", "optim", "tensor"},
    "parallel": {"blocks", "common", "device", "mesh", "model", "ops", "optim", "tensor"},
    "ckpt": {"common", "device", "mesh", "model"},
    "train": {"blocks", "ckpt", "common", "data", "device", "hw", "mesh", "model", "ops", "optim", "parallel", "tensor"},
    "generate": {"blocks", "ckpt", "common", "data", "device", "mesh", "model", "ops", "optim", "tensor", "train"},
    "eval": {"ckpt", "common", "data", "model", "ops", "train"},
    "size": {"common", "hw", "mesh", "model", "optim", "parallel", "train"},
    # bench linattn times an op alone (ops/cuda/linear_attention.h)
    "bench": {"common", "device", "hw", "model", "ops", "optim", "tensor"},
    # the supervisor drives keel train from outside: it reads train configs and checkpoint roots
    "run": {"ckpt", "common", "device", "train"},
    "cli": {"bench", "ckpt", "common", "data", "eval", "generate", "run", "size", "train"},
}


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    inc = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')
    bad = []
    edges = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            module = os.path.relpath(path, root).split(os.sep)[0]
            if module not in ALLOWED:
                bad.append(f"{os.path.relpath(path, root)}: module '{module}' has no floor in tests/check_floors.py")
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    m = inc.match(line)
                    if not m or m.group(1) == module:
                        continue
                    target = m.group(1)
                    edges.setdefault(module, set()).add(target)
                    if target not in ALLOWED[module]:
                        bad.append(f"src/{os.path.relpath(path, root)}:{n}: {module}/ may not include {target}/")
    # cycles between modules (ALLOWED itself must be acyclic too)
    graph = {m: set(ALLOWED[m]) | edges.get(m, set()) for m in ALLOWED}
    state = {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                bad.append("cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            elif state.get(t) is None:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if state.get(m) is None:
            visit(m, [m])
    for b in bad:
        print(b)
    if bad:
        return 1
    print(f"floors: {sum(len(v) for v in edges.values())} module dependencies, all allowed, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
