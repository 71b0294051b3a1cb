"""Where the sampler's generators stand during an epoch the facade drew up front, as under torch.

``procpipe.torch.DataLoader`` draws a map-style epoch's sampler items when the epoch starts
(``sampling.SamplerBatches``: the engine plans the epoch's batches). torch's iterator pulls
them as it goes: ``prefetch_factor * num_workers`` items when it starts, then one per batch
returned (none ahead without workers), and one past the last when the epoch ends. What the
sampler draws from its generators on the way is drawn at that pull: torch's ``RandomSampler``
draws its permutation at the first pull, and a trailing ``randperm`` only when it is exhausted.
So after an epoch abandoned midway (``break``), torch's generator has not made that trailing
draw, and every later epoch's order depends on it.

``PullStates`` draws the whole epoch, noting the generators' states after each pull where they
changed, and then sets the generators to the state torch's would have at each point of the
epoch (``advance``): the draw is made once, and the generators read by later epochs (or by the
program between two batches) stand where torch's stand.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["PullStates", "generators_of"]


def generators_of(index_sampler: Any, loader_generator: torch.Generator | None) -> list[torch.Generator]:
    """The generators an epoch's sampler draw may use: the samplers' own, and the loader's
    (or torch's global one, which torch's samplers use without a generator), each once."""
    found: list[torch.Generator] = []
    for obj in (index_sampler, getattr(index_sampler, "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not x for x in found):
            found.append(g)
    g = loader_generator if loader_generator is not None else torch.default_generator
    if all(g is not x for x in found):
        found.append(g)
    return found


def _states(generators: list[torch.Generator]) -> tuple[bytes, ...]:
    return tuple(g.get_state().numpy().tobytes() for g in generators)


class PullStates:
    """One epoch's sampler items, drawn at once, and the generators' states along the pulls."""

    def __init__(self) -> None:
        self._generators: list[torch.Generator] = []
        # (pulls made, {generator: its state after them}): the generators that changed at that pull
        self._points: list[tuple[int, dict[int, bytes]]] = []
        self._applied = -1  # the last point the generators were set to
        self._fresh = False  # drawn, not advanced yet: the generators stand at the end of the draw

    def draw(self, sampler: Iterable[Any], generators: list[torch.Generator]) -> list[Any]:
        """All of ``sampler``'s items; the generators are left where a full pull left them."""
        last = _states(generators)
        points = [(0, dict(enumerate(last)))]
        items: list[Any] = []
        iterator = iter(sampler)
        while True:
            try:
                items.append(next(iterator))
            except StopIteration:
                ended = True
            else:
                ended = False
            now = _states(generators)
            if now != last:
                points.append((len(items) + ended, {i: s for i, s in enumerate(now) if s != last[i]}))
                last = now
            if ended:
                break
        self._generators, self._points, self._applied, self._fresh = generators, points, len(points) - 1, True
        return items

    def advance(self, pulls: int) -> None:
        """Set the generators to their states after ``pulls`` pulls (where torch's iterator would have
        drawn so far). Right after the draw they may go back; later, only forward, and only the
        generators the sampler drew from at the pulls passed (the dataset's or the program's own
        draws from a generator between two pulls are kept)."""
        points = self._points
        if not points:
            return
        if self._fresh:  # every generator to its state at the last point at or before pulls
            self._fresh = False
            target = 0
            while target + 1 < len(points) and points[target + 1][0] <= pulls:
                target += 1
            states: dict[int, bytes] = {}
            for _, changed in points[: target + 1]:
                states.update(changed)
            self._set(states)
            self._applied = target
            return
        while self._applied + 1 < len(points) and points[self._applied + 1][0] <= pulls:
            self._applied += 1
            self._set(points[self._applied][1])

    def _set(self, states: dict[int, bytes]) -> None:
        for i, state in states.items():
            self._generators[i].set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def finish(self) -> None:
        """The epoch ended (every item pulled, and one past the last): the states a full pull leaves."""
        if not self._fresh:
            self.advance(1 << 62)
        self._points = []

    def forget(self) -> None:
        """Leave the generators where the draw left them (a resumed epoch: they were restored)."""
        self._points = []
