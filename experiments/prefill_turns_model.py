"""A model of the Hopper prefill kernel's consumer turn hand-off (csrc/attention_prefill_sm90.cuh), to check
the protocol itself: two warpgroups (128 threads each) hand tensor-core turns over named barriers 3 and 4
(count 256). `bar.arrive` adds 128 and never blocks; `bar.sync` adds 128 and blocks until its phase
completes; a phase completes when the count reaches 256, releasing whoever waits, and the count restarts.

Each consumer runs its op list for a sequence of items (n key tiles each, possibly none) with random durations
for the work between barrier ops; the run deadlocks when both wait forever. Protocols:
  `old`      the kernel up to session 11: consumer 1 does not hand back an item's final turn, so consumer 0 can
             arrive twice at barrier 4 (an item's last turn and the next item's first) before consumer 1 waits;
  `handback` consumer 1 hands back the final turn and consumer 0 takes it before its next item (correct, but
             consumer 0 then waits for consumer 1's last softmax: 1.2x slower at 4,096 tokens on the H200);
  `parity`   consumer 0's hand-offs go to barrier 4 or 5 by the parity of the item (counting items with key
             tiles), so its two back-to-back arrivals land on different barriers, and before it can arrive
             at the same one again it has taken a turn from consumer 1 within the next item.
Usage: python prefill_turns_model.py [trials]
"""

from __future__ import annotations

import random
import sys

PROTOCOLS = ("old", "handback", "parity")


def ops(cw: int, tiles: list[int], proto: str) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    owed = False
    k = 0  # items with key tiles so far
    for n in tiles + [None]:  # None: the sentinel
        if proto == "handback" and cw == 0 and owed:
            out.append(("sync", 3))
        owed = False
        if n is None:
            break
        # barrier 3: consumer 0 takes; 4 (or 5 for odd items under `parity`): consumer 1 takes
        to1 = 4 + (k & 1 if proto == "parity" else 0)
        mine, theirs = (3, to1) if cw == 0 else (to1, 3)
        for it in range(n):
            if it > 0 or cw == 1:
                out.append(("sync", mine))
            out.append(("work", "mma"))
            out.append(("arrive", theirs))
            out.append(("work", "softmax"))
        if n > 0:
            out.append(("sync", mine))  # final P V
            out.append(("work", "mma"))
            if cw == 0 or proto == "handback":
                out.append(("arrive", theirs))
                owed = True
            k += 1
        out.append(("work", "epilogue"))
    return out


def run(tiles: list[int], proto: str, rng: random.Random, slow_softmax: float) -> bool:
    """True when both consumers get to the end and every phase of a barrier paired the two consumers."""
    prog = [ops(0, tiles, proto), ops(1, tiles, proto)]
    pc = [0, 0]
    clock = [0.0, 0.0]
    count = {3: 0, 4: 0, 5: 0}
    phase = {3: 0, 4: 0, 5: 0}
    members: dict[int, set[int]] = {3: set(), 4: set(), 5: set()}
    waiting: dict[int, tuple[int, int]] = {}  # consumer -> (barrier, phase it waits for)
    dur = {"mma": (0.5, 1.0), "softmax": (0.5, 1.0 + slow_softmax), "epilogue": (0.5, 1.5)}
    while True:
        runnable = [c for c in (0, 1) if pc[c] < len(prog[c]) and c not in waiting]
        if not runnable:
            return pc[0] == len(prog[0]) and pc[1] == len(prog[1])
        c = min(runnable, key=lambda k: clock[k])  # the consumer whose next op comes first in time
        op, arg = prog[c][pc[c]]
        pc[c] += 1
        if op == "work":
            lo, hi = dur[arg]
            clock[c] += rng.uniform(lo, hi)
            continue
        bar = arg
        if c in members[bar]:
            return False  # a second arrival of one consumer in one phase: the pairing is broken
        members[bar].add(c)
        count[bar] += 128
        if count[bar] == 256:
            count[bar] = 0
            members[bar].clear()
            phase[bar] += 1
            for w, (b, ph) in list(waiting.items()):
                if b == bar and ph <= phase[bar]:
                    clock[w] = max(clock[w], clock[c])
                    del waiting[w]
        elif op == "sync":
            waiting[c] = (bar, phase[bar] + 1)


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    rng = random.Random(0)
    for proto in PROTOCOLS:
        hangs = 0
        for _ in range(trials):
            tiles = [rng.randint(0, 4) for _ in range(rng.randint(1, 12))]
            if not run(tiles, proto, rng, slow_softmax=rng.choice([0.0, 1.0, 3.0])):
                hangs += 1
        print(f"{proto} protocol: {hangs} of {trials} random runs deadlock or mis-pair")


if __name__ == "__main__":
    main()
