#!/usr/bin/env python3
"""Writes keel's demo corpus: original text generated from the small grammar below.

Everything here is written for keel (no third-party text): short stories about a handful of
characters, and sentences about arithmetic, counting and lists. The structure varies enough
for a tiny model's loss to fall. Deterministic: the same files every run.

    python3 data/corpus/generate.py          # rewrites stories.{jsonl,txt}, arithmetic.{jsonl,txt}
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

NAMES = ["Ada", "Bruno", "Chloe", "Dev", "Elena", "Felix", "Greta", "Hugo", "Iris", "Jonas", "Kira", "Leo",
         "Mina", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara"]
ANIMALS = ["cat", "dog", "fox", "owl", "goat", "duck", "horse", "rabbit", "turtle", "crow"]
PLACES = ["a small village", "the old mill", "a house by the river", "the edge of the forest", "a busy town",
          "a farm on the hill", "a boat on the lake", "the top of a tower", "a quiet street", "a garden"]
OBJECTS = ["a red kite", "a wooden box", "a silver key", "a loaf of bread", "a blue lamp", "a map", "a drum",
           "a basket of apples", "a warm coat", "a little bell", "a clock", "a jar of honey"]
FEELINGS = ["happy", "tired", "curious", "worried", "proud", "surprised", "calm", "hungry"]
WEATHER = ["It was raining", "The sun was bright", "A cold wind blew", "Snow covered the ground",
           "The sky was grey", "It was a warm evening"]
TIMES = ["One morning", "Later that day", "In the evening", "The next day", "At noon", "After a while"]
VERBS = [("found", "under a tree"), ("lost", "near the bridge"), ("carried", "across the field"),
         ("fixed", "with some string"), ("painted", "with bright colours"), ("shared", "with a friend")]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve"]


def story(r):
    a, b = r.sample(NAMES, 2)
    pet = r.choice(ANIMALS)
    place = r.choice(PLACES)
    obj = r.choice(OBJECTS)
    out = []
    opening = r.randrange(3)
    if opening == 0:
        out.append(f"Once upon a time, {a} lived in {place} with a {pet}.")
    elif opening == 1:
        out.append(f"{a} and a {pet} lived in {place}.")
    else:
        out.append(f"In {place} there lived a {pet} and its friend {a}.")
    for _ in range(r.randint(2, 6)):
        kind = r.randrange(6)
        if kind == 0:
            out.append(f"{r.choice(WEATHER)}, and {a} felt {r.choice(FEELINGS)}.")
        elif kind == 1:
            verb, how = r.choice(VERBS)
            out.append(f"{r.choice(TIMES)}, {a} {verb} {obj} {how}.")
        elif kind == 2:
            n = r.randint(2, 9)
            out.append(f"The {pet} saw {NUMBER_WORDS[n]} birds and counted them: "
                       + ", ".join(NUMBER_WORDS[1:n + 1]) + ".")
        elif kind == 3:
            out.append(f"{b} came to visit and asked, \"Where did you get {obj}?\"")
            out.append(f"\"I {r.choice(VERBS)[0]} it,\" said {a}.")
        elif kind == 4:
            out.append(f"{a} gave the {pet} some water, because the {pet} was {r.choice(FEELINGS)}.")
        else:
            k = r.randint(2, 5)
            out.append(f"{a} walked {NUMBER_WORDS[k]} miles to {r.choice(PLACES)} and back.")
    ending = r.randrange(3)
    if ending == 0:
        out.append(f"In the end, {a} and the {pet} were {r.choice(FEELINGS)}.")
    elif ending == 1:
        out.append(f"That night, {a} put {obj} away and went to sleep.")
    else:
        out.append(f"{b} said goodbye, and {a} waved until {b} was gone.")
    return " ".join(out)


def arithmetic(r):
    lines = []
    for _ in range(r.randint(3, 8)):
        kind = r.randrange(8)
        x, y = r.randint(0, 50), r.randint(0, 50)
        if kind == 0:
            lines.append(f"{x} plus {y} is {x + y}.")
        elif kind == 1:
            hi, lo = max(x, y), min(x, y)
            lines.append(f"{hi} minus {lo} is {hi - lo}.")
        elif kind == 2:
            x, y = r.randint(0, 12), r.randint(0, 12)
            lines.append(f"What is {x} times {y}? It is {x * y}.")
        elif kind == 3:
            a = r.randint(0, 40)
            n = r.randint(3, 8)
            lines.append(f"Count from {a} to {a + n}: " + ", ".join(str(v) for v in range(a, a + n + 1)) + ".")
        elif kind == 4:
            xs = [r.randint(0, 99) for _ in range(r.randint(3, 7))]
            lines.append(f"The list {xs} sorted is {sorted(xs)}.")
        elif kind == 5:
            xs = [r.randint(0, 99) for _ in range(r.randint(2, 6))]
            lines.append("The largest of " + ", ".join(map(str, xs)) + f" is {max(xs)}, and the smallest is {min(xs)}.")
        elif kind == 6:
            xs = [r.randint(0, 20) for _ in range(r.randint(2, 5))]
            lines.append("The sum of " + " and ".join(map(str, xs)) + f" is {sum(xs)}.")
        else:
            q = r.randint(1, 9)
            d = r.randint(1, 9)
            lines.append(f"{q * d} divided by {d} is {q}.")
    return " ".join(lines)


def write(name, docs):
    with open(os.path.join(HERE, name + ".jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    with open(os.path.join(HERE, name + ".txt"), "w") as f:
        f.write("\n\n".join(docs) + "\n")


def main():
    r = random.Random(20251121)
    write("stories", [story(r) for _ in range(220)])
    write("arithmetic", [arithmetic(r) for _ in range(300)])


if __name__ == "__main__":
    main()
