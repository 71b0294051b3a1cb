"""The coordinator thread and its workers: epochs and jobs around their plans, the worker
pool (``pool.WorkerPool``), attempts, faults, autotune, starting it all.
"""
