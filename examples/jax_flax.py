"""Train a small Flax NNX model with Optax on a Python preprocessing pipeline, through procpipe.jax.

The samples are made in Python in the workers (a noisy 8x8 "glyph" per class, shifted at
random with ``procpipe.sample_rng()``); ``procpipe.jax.iterator`` hands the training loop
each batch as global ``jax.Array``s, the batch split over the devices (here 2 CPU devices,
so that the example shows the data-parallel layout on any machine), made ahead in a thread.
Midway through epoch 1 the model, the optimizer and the loader's position are saved with
Orbax; a fresh model and loader restore them and finish the epoch: the samples of epoch 1
are then exactly those of an uninterrupted epoch.

    python examples/jax_flax.py
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # 2 CPU devices for the demo
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import procpipe
import procpipe.jax

CLASSES = 4
SAMPLES = 1024
GLYPHS = np.random.default_rng(0).random((CLASSES, 8, 8)) > 0.5


def make_sample(i: int) -> dict:
    """Python preprocessing: the class's glyph, shifted and noised (per-sample, reproducible)."""
    rng = procpipe.sample_rng()
    label = i % CLASSES
    image = np.roll(GLYPHS[label], rng.integers(-1, 2, size=2), axis=(0, 1)).astype(np.float32)
    image += rng.normal(0, 0.3, image.shape).astype(np.float32)
    return {"image": image.reshape(-1), "label": np.int32(label), "id": np.int32(i), "name": f"glyph-{i}"}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model: MLP, image: jax.Array, label: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(image), label).mean()


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, image: jax.Array, label: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, image, label)
    optimizer.update(model, grads)
    return loss


def new_model(replicated: NamedSharding) -> tuple[MLP, nnx.Optimizer]:
    """A model and its optimizer, their state replicated on every device (the batch is split over them)."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))
    return model, optimizer


def new_loader() -> procpipe.Loader:
    return procpipe.Loader(
        range(SAMPLES),
        make_sample,
        batch_size=64,
        workers=2,
        shuffle=True,
        seed=1,
        drop_last=True,
        shard=procpipe.jax.shard(),
    )


def main() -> None:
    sharding = procpipe.jax.default_sharding()
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    print(f"devices: {jax.device_count()}, batch sharding: {sharding.spec}")
    model, optimizer = new_model(replicated)
    checkpoints = tempfile.mkdtemp(prefix="procpipe-jax-example-")
    manager = ocp.CheckpointManager(checkpoints)

    with new_loader() as loader:
        batches = procpipe.jax.iterator(loader, sharding, prefetch=2)
        for batch in batches:  # epoch 0
            loss = train_step(model, optimizer, batch["image"], batch["label"])
        image = batch["image"]
        print(
            f"epoch 0: loss {float(loss):.3f}; batch image {image.shape} {image.dtype} over "
            f"{len(image.sharding.device_set)} devices, names stay a {type(batch['name']).__name__} of str"
        )

        seen: list[int] = []
        for step, batch in enumerate(batches):  # epoch 1, saved midway
            loss = train_step(model, optimizer, batch["image"], batch["label"])
            seen += np.asarray(batch["id"]).tolist()
            if step == 5:
                manager.save(
                    6,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(nnx.state((model, optimizer))),
                        loader=procpipe.jax.LoaderSave(loader),
                    ),
                )
                manager.wait_until_finished()
                break
    print(f"epoch 1: saved after 6 batches ({len(seen)} samples), loss {float(loss):.3f}")

    # a fresh process would start here: a new model and loader, restored from the checkpoint
    model, optimizer = new_model(replicated)
    with new_loader() as loader:
        restored = manager.restore(
            6,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(nnx.state((model, optimizer))), loader=procpipe.jax.LoaderRestore(loader)
            ),
        )
        nnx.update((model, optimizer), restored["state"])
        for batch in procpipe.jax.iterator(loader, sharding):
            loss = train_step(model, optimizer, batch["image"], batch["label"])
            seen += np.asarray(batch["id"]).tolist()
        accuracy = float((model(batch["image"]).argmax(-1) == batch["label"]).mean())
    manager.close()
    shutil.rmtree(checkpoints)
    print(
        f"epoch 1: resumed at epoch {restored['loader']['epoch']}, batch {restored['loader']['done_below']}; "
        f"loss {float(loss):.3f}, accuracy on the last batch {accuracy:.2f}"
    )
    every = sorted(seen) == list(range(SAMPLES - SAMPLES % 64))
    print(f"epoch 1 across the restart: {len(seen)} samples, each once: {'yes' if every else 'NO'}")


if __name__ == "__main__":
    main()
