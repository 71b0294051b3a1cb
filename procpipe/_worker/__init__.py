"""What runs in a worker process: the process's loop, producing one batch (fn, the cache,
augment, collation, batch_fn), Records, and starting a worker (start method, preload).
"""
