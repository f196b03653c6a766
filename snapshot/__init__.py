"""Committed state outside the worker: host-memory snapshots (shared memory owned by the agent) and durable copies.

Used by both sides of the host: libworker writes and restores snapshots, the
agent creates, reports, flushes and removes them. Nothing here talks to the
control plane.
"""
