"""Leaves that know nothing of processes or epochs: argument checks, counters, the ring and
the files procpipe creates (shm), collation and leases, RNG, delivery order, the wire.
"""
