"""Dataset metadata in shared memory: procpipe.Records instead of a big Python list.

A dataset's index is often a long list of dicts (file name, label, size...). Every worker
that reads such a list copies, page by page, the memory it touches: reading a Python
object writes its reference count (pytorch#13246). ``procpipe.Records`` packs the same
list column-wise into one read-only shared-memory file: ``records[i]`` still gives a
dict, but workers share one copy of the data, and the dataset pickles to ~100 bytes.

The script reads 200,000 records for one shuffled epoch with 2 forked workers, from the
plain list and from Records, and prints how much each worker's private memory (USS) grew.

Run: python examples/records_metadata.py
"""
import os
import pickle
import tempfile

import numpy as np
import psutil

import procpipe

N = 200_000
CLASSES = 100
MiB = 2**20


def make_metadata(n):
    """A dataset index as it often arrives: one dict per image."""
    return [{"path": f"/data/train/{i % CLASSES:03d}/{i:07d}.jpg", "label": i % CLASSES, "width": 200 + i % 300}
            for i in range(n)]


class ImageDataset:
    """Reads its metadata like any list; works the same over a list or a Records."""

    def __init__(self, metadata):
        self.metadata = metadata

    def __len__(self):
        return len(self.metadata)

    def __getitem__(self, i):
        record = self.metadata[i]
        image = np.full((8, record["width"] % 8 + 1), record["label"], np.uint8)  # stand-in for decoding the file
        return {"pixels": int(image.sum()), "label": record["label"], "path": record["path"]}


def worker_growth(metadata):
    """One shuffled epoch with 2 forked workers: (labels seen, growth of the workers' USS in MiB)."""
    labels = []
    with procpipe.Loader(ImageDataset(metadata), batch_size=500, workers=2, start_method="fork",
                         shuffle=True) as loader:
        batches = iter(loader)
        labels += next(batches)["label"].tolist()
        start = sum(psutil.Process(pid).memory_full_info().uss for pid in loader.worker_pids)
        for batch in batches:
            labels += batch["label"].tolist()
        end = sum(psutil.Process(pid).memory_full_info().uss for pid in loader.worker_pids)
    return sorted(labels), (end - start) / MiB


if __name__ == "__main__":
    metadata = make_metadata(N)
    records = procpipe.Records(metadata)  # packed once, in the parent
    print(records)
    print("records[0]:  ", records[0])
    print("records[-1]: ", records[-1])
    print("records[10:12] is a view:", list(records[10:12]))
    counts = np.bincount(records.column("label"))  # a numeric column is a numpy array, no copy
    print(f"labels: {len(counts)} classes, {counts.min()} to {counts.max()} images each")
    print(f"pickled dataset: list {len(pickle.dumps(ImageDataset(metadata))) / MiB:.1f} MiB, "
          f"Records {len(pickle.dumps(ImageDataset(records)))} bytes")

    seen_list, grew_list = worker_growth(metadata)
    seen_records, grew_records = worker_growth(records)
    assert seen_list == seen_records == sorted(r["label"] for r in metadata)
    print(f"workers' USS growth over one epoch: list {grew_list:.1f} MiB, Records {grew_records:.1f} MiB")
    print(f"workers grew less with Records: {'yes' if grew_records < grew_list / 4 else 'no'}")

    with tempfile.TemporaryDirectory() as directory:  # keep it on disk; load() maps it
        path = os.path.join(directory, "train.records")
        records.save(path)
        loaded = procpipe.Records.load(path)
        print("saved and loaded back, same records:", list(loaded[:1000]) == metadata[:1000])
        loaded.close()
    records.close()
