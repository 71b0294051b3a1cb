"""Stragglers: interleaved slow and fast items, ordered vs sloppy delivery.

Every 4th item takes 0.25 s (think: a cold cache or a slow disk read), the others 0.02 s.
With ``ordered=True`` the loader yields batches in sampler order, so every fast batch
queued behind a slow one waits for it (head-of-line blocking). With ``ordered=False``
("sloppy") it yields whichever batch is ready first: the fast batches keep flowing while
the slow ones are in progress, and every batch is still delivered exactly once.

Run: python examples/straggler_demo.py
"""
import time

import procpipe

N = 16
SLOW_EVERY = 4


def load(i):
    time.sleep(0.25 if i % SLOW_EVERY == 0 else 0.02)  # stands for I/O of uneven latency
    return i


def run(ordered):
    with procpipe.Loader(list(range(N)), load, batch_size=None, workers=2, ordered=ordered) as loader:
        list(loader)  # warm-up epoch: workers started and the ring sized, as in training
        started = time.perf_counter()
        order, arrivals = [], []
        for item in loader:
            order.append(int(item))
            arrivals.append(time.perf_counter() - started)
    total = arrivals[-1]
    fast = [t for i, t in zip(order, arrivals) if i % SLOW_EVERY]
    print(f"ordered={ordered!s:5}  total {total:.2f} s, mean arrival of the fast items {sum(fast) / len(fast):.2f} s")
    print("  order:   ", order)
    print("  arrivals:", " ".join(f"{t:.2f}" for t in arrivals))
    return order, total, sum(fast) / len(fast)


if __name__ == "__main__":
    print(f"{N} items, every {SLOW_EVERY}th slow (0.25 s), the others 0.02 s, 2 workers")
    ordered_order, ordered_total, ordered_fast = run(True)
    sloppy_order, sloppy_total, sloppy_fast = run(False)
    assert ordered_order == list(range(N)), "ordered delivery follows the sampler"
    assert sorted(sloppy_order) == list(range(N)), "sloppy delivery still yields every item once"
    print(f"sloppy order differs from sampler order: {sloppy_order != ordered_order}")
    print(f"fast items arrive on average {ordered_fast - sloppy_fast:+.2f} s earlier with ordered=False")
