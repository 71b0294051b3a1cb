"""The Hugging Face ``Trainer`` loading through procpipe: ``procpipe.torch.transformers``.

The ``Trainer`` builds torch's ``DataLoader`` itself (``Trainer._get_dataloader``: the dataset,
its sampler, ``data_collator``, the ``dataloader_*`` arguments, a ``worker_init_fn`` seeding each
worker) and prepares it with its ``Accelerator``. One line makes it load through procpipe::

    from procpipe.torch.transformers import Trainer      # was: from transformers import Trainer

or, for a Trainer class of your own (or another library's, such as TRL's), the mixin first::

    class MyTrainer(ProcpipeTrainerMixin, SFTTrainer): ...

``get_train_dataloader`` / ``get_eval_dataloader`` / ``get_test_dataloader`` let the Trainer build
and prepare its loader as it always does, then put a ``procpipe.torch.DataLoader`` with the same
dataset, sampler (sharded by Accelerate) and arguments in place of the torch loader inside the
prepared one (``procpipe.torch.accelerate.procpipe_backed``). procpipe's own options come from the
class attribute (or instance attribute) ``procpipe_options``, e.g. ``{"seed_globals": True}``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import transformers

from .accelerate import procpipe_backed

__all__ = ["ProcpipeTrainerMixin", "Trainer"]


class ProcpipeTrainerMixin:
    """Put before a ``transformers.Trainer`` class in the bases: its loaders load through procpipe."""

    procpipe_options: ClassVar[dict[str, Any]] = {}  # procpipe.torch.DataLoader's own keyword arguments

    def get_train_dataloader(self) -> Any:
        return procpipe_backed(super().get_train_dataloader(), self.procpipe_options)  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return procpipe_backed(super().get_eval_dataloader(eval_dataset), self.procpipe_options)  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return procpipe_backed(super().get_test_dataloader(test_dataset), self.procpipe_options)  # type: ignore[misc]


class Trainer(ProcpipeTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose loaders load through procpipe (module docstring)."""
