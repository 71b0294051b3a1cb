"""Text: a file of sentences and a file of labels, read side by side and zipped line by line.

The tf.data version this mirrors::

    tf.data.Dataset.zip((tf.data.TextLineDataset("sentences.txt"),
                         tf.data.TextLineDataset("labels.txt")))

With procpipe the two files form one shard of a ``procpipe.Shards`` source: its
``open_fn`` opens both and reads them in step (``zip``), so line i of one is paired with
line i of the other, whatever the number of workers. ``fn`` then tokenizes each pair in
the workers, and records are batched as usual.

Real corpora come split into parts (``sentences-00.txt``/``labels-00.txt``, ...): each
pair of parts is a shard, and ``cycle_length`` pairs are read at once, by different
workers, their records interleaved ``block_length`` at a time (tf.data's ``interleave``).
The second half of this example does that, with a shuffle buffer.

Run: python examples/text_zip.py
"""
import os
import tempfile
import zlib

import numpy as np

import procpipe

WORDS = ["acting", "film", "plot", "cast", "story", "score", "ending", "pace"]
GOOD, BAD = ["great", "moving", "clever", "fun"], ["dull", "messy", "flat", "slow"]
MAX_TOKENS = 8


def write_corpus(directory, n=200, parts=1):
    """Sentences and labels (1: positive) in ``parts`` pairs of files; returns the pairs."""
    rng = np.random.default_rng(0)
    pairs = []
    for part in range(parts):
        suffix = "" if parts == 1 else f"-{part:02d}"
        sentences = os.path.join(directory, f"sentences{suffix}.txt")
        labels = os.path.join(directory, f"labels{suffix}.txt")
        with open(sentences, "w") as s, open(labels, "w") as l:
            for i in range(part, n, parts):
                label = int(rng.integers(2))
                adjective = (GOOD if label else BAD)[int(rng.integers(4))]
                s.write(f"line {i}: the {WORDS[i % len(WORDS)]} was {adjective}\n")
                l.write(f"{label}\n")
        pairs.append((sentences, labels))
    return pairs


def zip_lines(pair):
    """open_fn: one record per line pair, (sentence, label). Runs in a worker."""
    sentences, labels = pair
    with open(sentences) as s, open(labels) as l:
        for sentence, label in zip(s, l, strict=True):
            yield sentence.rstrip("\n"), int(label)


def tokenize(record):
    """fn: words to ids (a stable hash), padded to MAX_TOKENS; runs in the workers."""
    sentence, label = record
    ids = [zlib.crc32(w.encode()) % 10_000 + 1 for w in sentence.split()][:MAX_TOKENS]
    tokens = np.zeros(MAX_TOKENS, np.int32)
    tokens[:len(ids)] = ids
    return {"text": sentence, "tokens": tokens, "label": label}


def check(batches, n):
    """Every line exactly once, each sentence with its own label."""
    seen = []
    for batch in batches:
        for text, label in zip(batch["text"], batch["label"]):
            positive = any(text.endswith(w) for w in GOOD)
            assert positive == bool(label), (text, label)
            seen.append(int(text.split(":")[0].split()[1]))
    assert sorted(seen) == list(range(n)), "every line pair exactly once"
    return seen


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        # 1. Two files, zipped line by line.
        (pair,) = write_corpus(tmp)
        source = procpipe.Shards([pair], zip_lines)
        with procpipe.Loader(source, tokenize, batch_size=16, workers=2) as loader:
            batches = list(loader)
        first = batches[0]
        print(f"{sum(len(b['label']) for b in batches)} (sentence, label) pairs in {len(batches)} batches; "
              f"tokens {first['tokens'].shape} {first['tokens'].dtype}, labels {first['label'].dtype}")
        for text, label in list(zip(first["text"], first["label"]))[:4]:
            print(f"  {label}  {text}")
        seen = check(batches, 200)
        print("zipped line by line, in file order:", seen == list(range(200)))

        # 2. The same corpus in 4 pairs of parts: 2 pairs read at once by 2 workers, 4 records
        #    from each in turn, then mixed by a shuffle buffer of 64 records.
        parts = write_corpus(tmp, parts=4)
        source = procpipe.Shards(parts, zip_lines, cycle_length=2, block_length=4)
        orders = []
        for workers in (1, 2):
            with procpipe.Loader(source, tokenize, batch_size=16, workers=workers, shuffle=True, seed=1,
                                 shuffle_buffer=64) as loader:
                orders.append(check(list(loader), 200))
        print(f"4 pairs of parts, interleaved and shuffled: first lines {orders[0][:8]}")
        print("same order with 1 and 2 workers:", orders[0] == orders[1])
