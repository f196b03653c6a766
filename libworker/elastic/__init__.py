"""Horovod's `hvd.elastic` namespace: the elastic loop, State objects and the elastic sampler; and ours: declared
waits (`waiting`)."""

from libworker.elastic.declared_waits import waiting
from libworker.elastic.runner import run
from libworker.elastic.sampler import ElasticSampler
from libworker.elastic.state import ObjectState, State, TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run", "waiting"]
