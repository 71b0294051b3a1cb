"""procpipe.torch.DataLoader where frameworks build or change the loader (issue 42).

- torch's own reading of the loader: attributes assigned after construction, ``__getitems__``,
  the generator after an abandoned epoch, two iterators of persistent workers, ``copy.copy``;
- Lightning (``seed_everything(workers=True)``, its rebuild of a loader passed to ``fit``),
  Accelerate (``procpipe.torch.accelerate.Accelerator``, 1 and 2 processes under torchrun, gloo,
  CPU) and the Hugging Face ``Trainer`` (``procpipe.torch.transformers``), each skipped with a
  reason where the framework is not installed (CI installs them in .venv-frameworks).
"""

from __future__ import annotations

import copy
import random
import textwrap

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from conftest import run_python

import procpipe.torch as ppt
from procpipe._worker.identity import worker_index

LOADERS = [tud.DataLoader, ppt.DataLoader]


def _close(loader) -> None:
    if isinstance(loader, ppt.DataLoader):
        loader.close()


class Draws(tud.Dataset):
    """Each sample: its index and what the worker's global generators draw for it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return torch.tensor([i, int(torch.randint(10**6, (1,))), random.randrange(10**6), np.random.randint(10**6)])


class Loaded(tud.Dataset):
    """Its index, and which procpipe worker loaded it (-1: torch's worker, or no worker)."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        w = worker_index()
        return torch.tensor([i, -1 if w is None else w])


def _seed_init(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)
    random.seed(1000 + worker_id)
    np.random.seed(1000 + worker_id)


def _first_only(batch):
    return [sample[0] for sample in batch]


def _as_list(batch):
    return list(batch)


# --------------------------------------------------------------------------- torch's reading
@pytest.mark.parametrize("persistent", [False, True])
def test_attributes_assigned_after_construction_take_effect_as_in_torch(persistent):
    """torch reads worker_init_fn and collate_fn when an iterator starts: assigned after the
    DataLoader was built (as Lightning assigns worker_init_fn), they are used; same batches as torch."""
    got = []
    for cls in LOADERS:
        loader = cls(Draws(), batch_size=3, num_workers=2, persistent_workers=persistent,
                     generator=torch.Generator().manual_seed(0))
        loader.worker_init_fn = _seed_init
        loader.collate_fn = _first_only
        got.append([[t.tolist() for t in batch] for batch in loader])
        _close(loader)
    assert got[0] == got[1]
    assert all(len(batch) == 3 for batch in got[1])  # collate_fn (assigned later) made them


class ItemsDataset(tud.Dataset):
    """A dataset with ``__getitems__`` (as Hugging Face datasets have): counts its calls per process."""

    def __init__(self) -> None:
        self.log = None

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        raise AssertionError("torch loads a batch of a dataset with __getitems__ in one call")

    def __getitems__(self, indices: list[int]):
        return [{"x": torch.full((2,), i), "name": f"n{i}", "i": i, "batch": len(indices)} for i in indices]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("collate", [None, _as_list])
def test_getitems_loads_each_batch_in_one_call_as_torch(workers, collate):
    kwargs = {} if collate is None else {"collate_fn": collate}
    want = list(tud.DataLoader(ItemsDataset(), batch_size=4, num_workers=workers, **kwargs))
    loader = ppt.DataLoader(ItemsDataset(), batch_size=4, num_workers=workers, **kwargs)
    got = list(loader)
    loader.close()
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        if collate is None:
            assert a["name"] == b["name"] and torch.equal(a["x"], b["x"]) and torch.equal(a["i"], b["i"])
            assert a["batch"].tolist() == b["batch"].tolist()  # each sample saw its whole batch: one call
        else:
            assert [s["i"] for s in a] == [s["i"] for s in b]


def test_a_subset_of_a_dataset_without_getitems_loads_per_index():
    """torch's Subset has __getitems__, which is the per-index loop when its dataset has none: the
    samples are stacked straight into the ring as before."""
    subset = tud.Subset(list(range(10)), [3, 1, 4, 1, 5])
    got = ppt.DataLoader(subset, batch_size=2)
    assert [b.tolist() for b in got] == [b.tolist() for b in tud.DataLoader(subset, batch_size=2)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_order_after_an_abandoned_epoch_is_torchs(workers, drop_last):
    """torch's RandomSampler draws its trailing randperm only when exhausted; after epochs broken off,
    every later epoch's order (and the generator's next draws) are torch's."""
    got = []
    for cls in LOADERS:
        g = torch.Generator().manual_seed(0)
        loader = cls(list(range(20)), batch_size=4, shuffle=True, generator=g, num_workers=workers,
                     drop_last=drop_last)
        it = iter(loader)
        next(it)
        del it
        it = iter(loader)
        for _ in range(3):
            next(it)
        del it
        epochs = [[b.tolist() for b in loader] for _ in range(2)]
        got.append((epochs, torch.rand(3, generator=g).tolist()))
        _close(loader)
    assert got[0] == got[1]


def test_order_after_an_abandoned_epoch_with_the_global_generator_is_torchs():
    got = []
    for cls in LOADERS:
        torch.manual_seed(5)
        loader = cls(list(range(20)), batch_size=4, shuffle=True)
        it = iter(loader)
        next(it)
        del it
        got.append(([b.tolist() for b in loader], torch.rand(2).tolist()))
    assert got[0] == got[1]


def test_two_iterators_over_persistent_workers_are_torchs_one_reset():
    got = []
    for cls in LOADERS:
        loader = cls(list(range(12)), batch_size=2, num_workers=2, persistent_workers=True)
        first = iter(loader)
        head = [next(first).tolist() for _ in range(2)]
        second = iter(loader)
        got.append((first is second, head, [b.tolist() for b in first], [b.tolist() for b in loader]))
        _close(loader)
    assert got[0] == got[1]
    assert got[1][0] is True


def test_a_shallow_copy_has_its_own_engine():
    loader = ppt.DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)
    assert len(list(loader)) == 4
    clone = copy.copy(loader)
    assert [b.tolist() for b in clone] == [b.tolist() for b in loader]
    assert set(clone.worker_pids).isdisjoint(loader.worker_pids)
    clone.close()
    assert len(list(loader)) == 4  # the original's workers still run
    loader.close()


# --------------------------------------------------------------------------- Lightning
def test_lightning_seed_everything_workers_draws_what_torch_draws():
    pytest.importorskip("lightning", reason="Lightning is not installed (CI: .venv-frameworks)")
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn
    from lightning.fabric.utilities.seed import seed_everything

    got = []
    for cls in LOADERS:
        seed_everything(0, workers=True)
        loader = cls(Draws(), batch_size=3, num_workers=2)
        _auto_add_worker_init_fn(loader, rank=0)  # what Lightning does to a loader: assigns worker_init_fn
        assert loader.worker_init_fn is not None
        got.append([b.tolist() for b in loader])
        _close(loader)
    assert got[0] == got[1]


LIGHTNING_FIT = """
import sys, torch, torch.utils.data as tud
import lightning as L
import procpipe.torch as ppt
from procpipe._worker.identity import worker_index

class DS(tud.Dataset):
    def __len__(self): return 16
    def __getitem__(self, i):
        w = worker_index()
        return torch.tensor([float(i)]), torch.tensor(-1 if w is None else w)

class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = torch.nn.Linear(1, 1); self.seen = []
    def training_step(self, batch, i):
        x, w = batch; self.seen.append(w.tolist()); return self.layer(x).sum()
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.01)

shm = sys.argv[1]
loader = ppt.DataLoader(DS(), batch_size=4, num_workers=2, shuffle=True, shm_dir=shm, seed_globals=True)
model = M()
trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=int(sys.argv[2]), strategy=sys.argv[3],
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=True)
trainer.fit(model, train_dataloaders=loader)
used = trainer.train_dataloader
assert isinstance(used, ppt.DataLoader), type(used)
assert used.shm_dir == shm and used.seed_globals is True, (used.shm_dir, used.seed_globals)
assert model.seen and all(w in (0, 1) for batch in model.seen for w in batch), model.seen
print("OK", trainer.global_rank, len(model.seen))
"""


@pytest.mark.timeout_s(400)
@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_fit_loads_through_procpipe_and_keeps_its_options(devices, tmp_path, shm_dir):
    """trainer.fit(train_dataloaders=loader): Lightning rebuilds the loader from its attributes (with its
    DistributedSampler in 2 processes, gloo); procpipe's options survive, and the batches come from
    procpipe's workers."""
    pytest.importorskip("lightning", reason="Lightning is not installed (CI: .venv-frameworks)")
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_FIT)
    strategy = "auto" if devices == 1 else "ddp"
    proc = run_python([str(script), shm_dir, str(devices), strategy], timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK") == devices, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- Accelerate
ACCELERATE_RUN = """
import json, os, sys, torch, torch.utils.data as tud
import procpipe.torch as ppt
from procpipe.torch.accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from procpipe._worker.identity import worker_index

class DS(tud.Dataset):
    def __len__(self): return 22
    def __getitem__(self, i):
        w = worker_index()
        return torch.tensor([i]), torch.tensor(-1 if w is None else w)

split, even, stateful = (sys.argv[1] == "1"), (sys.argv[2] == "1"), (sys.argv[3] == "1")
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
    split_batches=split, even_batches=even, use_stateful_dataloader=stateful))
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = ppt.DataLoader(DS(), batch_size=4, shuffle=True, num_workers=2, seed_globals=True,
                        generator=torch.Generator().manual_seed(1))
model, opt, prepared = acc.prepare(model, opt, loader)
inner = prepared.base_dataloader
assert isinstance(inner, ppt.DataLoader) and inner.seed_globals is True, type(inner)
batches = [(x.flatten().tolist(), w.tolist()) for x, w in prepared]
assert all(w in (0, 1) for _, ws in batches for w in ws), batches  # procpipe's workers loaded them
skipped = acc.skip_first_batches(prepared, 1)
assert isinstance(skipped.base_dataloader, ppt.DataLoader)
rest = [x.flatten().tolist() for x, _ in skipped]
out = {"rank": acc.process_index, "batches": [b for b, _ in batches], "skipped": rest}
if stateful:
    it = iter(prepared)
    next(it)
    acc.save_state(sys.argv[4])
    want = [x.flatten().tolist() for x, _ in it]
    acc.wait_for_everyone()  # save_state writes the model on the main process only, after its barrier
    acc.load_state(sys.argv[4])
    out["resumed"] = [x.flatten().tolist() for x, _ in prepared] == want
print("RESULT " + json.dumps(out))
"""


def _accelerate_results(tmp_path, procs: int, split: bool, even: bool, stateful: bool) -> list[dict]:
    import json

    script = tmp_path / "acc.py"
    script.write_text(ACCELERATE_RUN)
    args = [str(script), str(int(split)), str(int(even)), str(int(stateful)), str(tmp_path / "ckpt")]
    if procs > 1:
        args = ["-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--standalone", *args]
    proc = run_python(args, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == procs, proc.stdout + proc.stderr
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.timeout_s(400)
@pytest.mark.parametrize("procs", [1, 2])
@pytest.mark.parametrize(("split", "even"), [(False, True), (True, True), (False, False)])
def test_accelerate_prepare_loads_through_procpipe_sharded_as_accelerate_shards(tmp_path, procs, split, even):
    """Accelerate shards the batches per process (BatchSamplerShard: split_batches, even_batches);
    procpipe's workers load them; skip_first_batches keeps procpipe."""
    pytest.importorskip("accelerate", reason="Accelerate is not installed (CI: .venv-frameworks)")
    results = _accelerate_results(tmp_path, procs, split, even, stateful=False)
    seen = sorted(i for r in results for b in r["batches"] for i in b)
    if even:  # every process the same number of full batches, the first samples repeated to fill them
        assert set(seen) == set(range(22)) and len({len(r["batches"]) for r in results}) == 1
    else:
        assert seen == list(range(22))
    for r in results:
        assert r["skipped"] == r["batches"][1:] or len(r["skipped"]) == len(r["batches"]) - 1
        if split and procs == 2:
            assert all(len(b) <= 2 for b in r["batches"])  # each process's part of a batch of 4


@pytest.mark.timeout_s(400)
@pytest.mark.parametrize("procs", [1, 2])
def test_accelerate_save_state_and_load_state_resume_procpipes_loader(tmp_path, procs):
    pytest.importorskip("accelerate", reason="Accelerate is not installed (CI: .venv-frameworks)")
    pytest.importorskip("torchdata", reason="use_stateful_dataloader needs torchdata (CI: .venv-frameworks)")
    for r in _accelerate_results(tmp_path, procs, split=False, even=True, stateful=True):
        assert r["resumed"] is True


# --------------------------------------------------------------------------- Hugging Face Trainer
HF_TRAIN = """
import os, sys, torch, torch.utils.data as tud
os.environ["HF_HUB_OFFLINE"] = "1"
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from procpipe.torch.transformers import Trainer
import procpipe.torch as ppt
from procpipe._worker.identity import worker_index

seen = []
class Tokens(tud.Dataset):
    def __len__(self): return 16
    def __getitem__(self, i):
        ids = torch.arange(8) + i
        return {"input_ids": ids, "labels": ids, "worker": torch.tensor(-1 if worker_index() is None else worker_index())}

def collate(samples):
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels")}
    seen.append([int(s["worker"]) for s in samples])
    return batch

class Seen(Trainer):
    procpipe_options = {"seed_globals": True}
    def training_step(self, model, inputs, *args, **kwargs):
        assert isinstance(self.train_loader.base_dataloader, ppt.DataLoader)
        return super().training_step(model, inputs, *args, **kwargs)
    def get_train_dataloader(self):
        self.train_loader = super().get_train_dataloader()
        return self.train_loader

model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=1))
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, num_train_epochs=1,
                         dataloader_num_workers=2, use_cpu=True, report_to=[], save_strategy="no",
                         logging_strategy="no", remove_unused_columns=False)
trainer = Seen(model=model, args=args, train_dataset=Tokens(), data_collator=collate)
result = trainer.train()
loader = trainer.train_loader.base_dataloader
assert isinstance(loader, ppt.DataLoader) and loader.seed_globals is True
print("OK", result.global_step)
"""


@pytest.mark.timeout_s(400)
def test_hugging_face_trainer_trains_through_procpipe(tmp_path):
    """procpipe.torch.transformers.Trainer: a tiny GPT-2 built in code (no download) trains one epoch on
    batches from procpipe's workers."""
    pytest.importorskip("transformers", reason="transformers is not installed (CI: .venv-frameworks)")
    pytest.importorskip("accelerate", reason="Accelerate is not installed (CI: .venv-frameworks)")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HF_TRAIN))
    proc = run_python([str(script), str(tmp_path / "out")], timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK 4" in proc.stdout, proc.stdout + proc.stderr

