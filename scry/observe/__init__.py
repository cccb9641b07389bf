"""Observers: fingerprints, statistics, events and metrics. Fed by hooks; never blocks the proxy."""
