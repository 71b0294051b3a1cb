"""Wrap existing preprocessing that works on dicts and plain Python objects.

The records are dicts holding strings, lists and nested dicts -- the kind of data that
existing preprocessing code (tokenizers, label maps, feature builders) works on. The
preprocessing function is used unchanged as procpipe's ``fn`` and runs in worker
processes; only its numeric output (numpy arrays, numbers) goes through shared memory,
strings and other objects travel alongside as Python lists.

Augmentation draws from ``procpipe.sample_rng()``: the generator of the sample being
produced, seeded from (seed, epoch, index). The output is therefore identical whatever
the number of workers -- the script checks it by comparing 1 worker with 2 -- and
differs from epoch to epoch.

Run: python examples/dict_preprocessing.py
"""
import time

import numpy as np

import procpipe

VOCAB = {w: i + 1 for i, w in enumerate("the a cat dog sat ran on under mat log fast slowly".split())}
LABELS = {"animal": 0, "furniture": 1, "motion": 2}
MAX_TOKENS = 8


def make_records(n):
    """Raw data as it often arrives: dicts with text, tags and metadata (no arrays)."""
    words = list(VOCAB)
    records = []
    for i in range(n):
        text = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(3 + i % 5))
        records.append({
            "id": f"rec-{i:04d}",
            "text": text,
            "tags": ["animal"] + (["motion"] if i % 3 else []) + (["furniture"] if i % 4 == 0 else []),
            "meta": {"source": "synthetic", "length": len(text)},
            "signal": [float((i * k) % 17) / 17.0 for k in range(16)],
        })
    return records


def preprocess(record):
    """Existing per-record preprocessing: dict in, dict out, plain Python and numpy."""
    rng = procpipe.sample_rng()  # per-sample generator: deterministic, independent of the worker
    tokens = [VOCAB.get(w, 0) for w in record["text"].split()]
    if len(tokens) > 1 and rng.random() < 0.5:  # augmentation: drop one random token
        del tokens[rng.integers(len(tokens))]
    ids = np.zeros(MAX_TOKENS, np.int64)
    ids[:min(len(tokens), MAX_TOKENS)] = tokens[:MAX_TOKENS]
    labels = np.zeros(len(LABELS), np.float32)
    for tag in record["tags"]:
        labels[LABELS[tag]] = 1.0
    signal = np.asarray(record["signal"], np.float32)
    signal += rng.normal(0.0, 0.05, signal.shape).astype(np.float32)  # augmentation: noise
    return {
        "id": record["id"],  # a str: collated into a list of str
        "tokens": ids,  # arrays: stacked straight into the shared-memory ring
        "labels": labels,
        "signal": signal,
        "length": record["meta"]["length"],  # an int: collated into an int64 array
    }


def run(records, workers):
    batches = []
    with procpipe.Loader(records, preprocess, batch_size=16, workers=workers, shuffle=True, seed=7) as loader:
        for epoch in range(2):
            started = time.perf_counter()
            epoch_batches = [{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in b.items()}
                             for b in loader]
            print(f"  workers={workers} epoch {epoch}: {len(epoch_batches)} batches "
                  f"in {time.perf_counter() - started:.3f} s")
            batches.append(epoch_batches)
    return batches


def same(a, b):
    return all(
        x.keys() == y.keys() and all(
            np.array_equal(x[k], y[k]) if isinstance(x[k], np.ndarray) else x[k] == y[k] for k in x)
        for ea, eb in zip(a, b) for x, y in zip(ea, eb)
    )


if __name__ == "__main__":
    records = make_records(160)
    print("a raw record:", records[0])
    one = run(records, workers=1)
    two = run(records, workers=2)
    first = two[0][0]
    print("a batch:", {k: (f"array{v.shape} {v.dtype}" if isinstance(v, np.ndarray) else f"list[{len(v)}]")
                       for k, v in first.items()})
    print("ids of the first batch:", first["id"][:4], "...")
    print("tokens[0]:", first["tokens"][0], "labels[0]:", first["labels"][0])
    assert same(one, two), "augmentation must not depend on the number of workers"
    print("identical output with 1 and 2 workers: yes")
    assert not np.array_equal(two[0][0]["signal"], two[1][0]["signal"]), "epochs should differ"
    print("epoch 0 and epoch 1 differ (new order, new augmentation): yes")
