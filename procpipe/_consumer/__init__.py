"""What the user's loop touches, besides ``procpipe.loader``: the epoch iterators, what they
are given (``iteration``), resume, argument validation, the device stage.
"""
