"""Moved to `plumbing.nursery` (shared plumbing); this path stays for code written against it."""

from plumbing.nursery import open_nursery as open_nursery
