"""The source kinds, one package each over one contract: ``indexed/`` (a dataset read by index),
``stream/`` (``procpipe.Shards``), ``mix/`` (``procpipe.Mix``, built on the other two). The contract
and what the kinds share: ``source_kind.py`` (``SourceKind``), ``epoch_plan.py`` (the per-epoch plan
contract, ``EpochPlan``), ``epoch_order.py`` (an epoch's permutation), ``saved_state.py`` (the
saved state's keys and positions), ``sample_names.py``, ``combined_load.py``; ``resolve.py`` picks a
source's kind once, ``combine.py`` is ``procpipe.combine_states``. Orders and plans are pure: no
process, thread or clock (pyproject.toml's import-linter contracts).
"""
