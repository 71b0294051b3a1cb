"""PyTorch training with procpipe.torch.DataLoader, timed against torch's own DataLoader.

The dataset is an ordinary ``torch.utils.data.Dataset``: it draws a synthetic 3x32x32
image per index with some Python/numpy work (standing for decoding and resizing) and
augments it with torch's global random generator (random flip and shift). Switching to
procpipe is one import: ``from procpipe.torch import DataLoader``; the training loop
does not change. Both loaders use 2 workers that persist across epochs; the script
prints the time of each epoch for each.

Run: python examples/torch_training.py
"""
import time

import numpy as np
import torch
import torch.nn as nn
import torch.utils.data

import procpipe.torch

N_TRAIN, BATCH, EPOCHS, WORKERS = 768, 64, 3, 2


def make_image(index):
    """A synthetic labelled image (channels first): stripes whose frequency is the class."""
    label = index % 10
    rng = np.random.default_rng(index)
    ys, xs = np.mgrid[0:32, 0:32].astype(np.float32) / 32.0
    image = np.empty((3, 32, 32), np.float32)
    for c in range(3):  # a little per-sample Python work, like decoding would be
        phase = rng.uniform(0, 2 * np.pi)
        image[c] = np.sin(2 * np.pi * (label + 1) * (xs + ys * (c - 1) * 0.3) + phase)
    image += rng.normal(0.0, 0.3, image.shape).astype(np.float32)
    return image, label


class SyntheticImages(torch.utils.data.Dataset):
    def __len__(self):
        return N_TRAIN

    def __getitem__(self, index):
        image, label = make_image(index)
        x = torch.from_numpy(image)
        if torch.rand(()) < 0.5:  # augmentation with torch's RNG
            x = x.flip(-1)
        shift = int(torch.randint(-2, 3, ()))
        x = torch.roll(x, shift, dims=-2)
        return x, label


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    )


def train(loader_class, name):
    loader = loader_class(SyntheticImages(), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                          persistent_workers=True, generator=torch.Generator().manual_seed(0))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for epoch in range(EPOCHS):
        started = time.perf_counter()
        correct = seen = 0
        for x, y in loader:  # the same loop for both loaders
            optimizer.zero_grad()
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(1) == y).sum().item()
            seen += len(y)
        times.append(time.perf_counter() - started)
        print(f"  {name:28} epoch {epoch}: {times[-1]:.2f} s, loss {loss.item():.3f}, "
              f"train accuracy {correct / seen:.2f}")
    if hasattr(loader, "close"):
        loader.close()
    return times


if __name__ == "__main__":
    torch.set_num_threads(1)  # leave the other core to the workers (2-core machines)
    print(f"{N_TRAIN} synthetic images, batch {BATCH}, {WORKERS} workers, {EPOCHS} epochs each")
    stock = train(torch.utils.data.DataLoader, "torch.utils.data.DataLoader")
    ours = train(procpipe.torch.DataLoader, "procpipe.torch.DataLoader")
    print("time per epoch (s): " + ", ".join(
        f"epoch {e}: torch {a:.2f} / procpipe {b:.2f}" for e, (a, b) in enumerate(zip(stock, ours))))
    print(f"mean over epochs: torch {np.mean(stock):.2f} s, procpipe {np.mean(ours):.2f} s; "
          f"after the first epoch: torch {np.mean(stock[1:]):.2f} s, procpipe {np.mean(ours[1:]):.2f} s")
    print("(epoch 0 includes starting the workers: torch forks them, procpipe starts them from a "
          "fork-safe forkserver that first imports torch once)")
