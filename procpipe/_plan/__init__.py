"""Which work an epoch holds, pure (no process, thread or clock): the plan contract
(``base.EpochPlan``), an indexed source's plan (``index``) and its sampler. A stream's plan
is ``procpipe._streaming.shard_plan``.
"""
