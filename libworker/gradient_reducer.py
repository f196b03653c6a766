"""GradientReducer: the reduction of one DistributedOptimizer's gradients, bucket by bucket, while backward runs.

A hook on each parameter's gradient accumulation counts backward passes
(`backward_passes_per_step`); when every gradient of a bucket
(libworker.buckets) is ready, they are copied into its buffer, compressed,
pre-scaled, and the buffer's allreduce starts while backward goes on.
Buckets start strictly in layout order on every rank (a ready bucket waits
for the ones before it), since collectives pair up in the order they are
issued: a parameter that gets no gradient on some ranks cannot make ranks
reduce different buckets. `synchronize()` starts the buckets whose gradients
never came (as zeros, as Horovod), waits for all of them through the
abortable core, decompresses, and copies the results back into `.grad`,
applying the average and `gradient_predivide_factor` on the way. A
failed or aborted reduction raises WorkerInternalError from synchronize; the
hooks never raise into backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from libworker import process_sets
from libworker.buckets import Bucket
from libworker.collectives import finish, launch, waits_on_stream
from libworker.compression import Compressor
from libworker.errors import WorkerInternalError
from libworker.handles import StepAgreement, agree
from libworker.joining import counts_joins, joined_ranks_in, mark_active
from libworker.process_sets import ProcessSet
from libworker.reduction import TORCH_OPS, Adasum, Average
from libworker.signatures import Signature, TensorSignature


def _copy_scaled(grads: list[torch.Tensor], results: list[torch.Tensor], scale: float) -> None:
    """Copy a bucket's reduced results into the gradients, scaled on the way (one pass over the data, as DDP's
    division while copying into its buckets: a separate scaling pass would sit on the step's critical path)."""
    if scale == 1.0:
        torch._foreach_copy_(grads, results)
        return
    for grad, result in zip(grads, results):
        torch.mul(result, scale, out=grad)


class _NotAMember(Exception):
    """This rank is not in the optimizer's process set: the step reduces nothing (never raised to the user)."""


class GradientReducer:
    """The buckets of one optimizer (`layout`: each one's parameters), their hooks, and the reduction of one step.

    The first step of a round negotiates the whole bucket layout in full
    before any bucket moves, so a rank whose model differs fails on every rank
    with CollectiveMismatchError. The first bucket carries Horovod's join
    protocol's control element (libworker.joining): it tells every rank, at
    the same step, that a rank joined. So from then on, where that element
    counts joined ranks (`counts_joins`), a step may send nothing but its
    buckets (an unannounced step); otherwise the cached signature's one small
    allreduce is sent ahead of the first bucket without waiting (confirmed in
    synchronize).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        layout: list[list[torch.Tensor]],
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        process_set: ProcessSet,
        name: str,
    ) -> None:
        self.process_set = process_set
        self.name = name
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.predivide = gradient_predivide_factor
        self.sparse: set[torch.Tensor] = set()
        self.buckets = [Bucket.of(group, control=index == 0) for index, group in enumerate(layout)]
        self.counts_joins = counts_joins(op, compression)
        self.signature = self._layout_signature()
        self.group: Any = None
        self.step_error: BaseException | None = None
        self.agreement = StepAgreement()
        self.delay = {p: backward_passes_per_step for p in params}
        self.touched = False
        self.next_launch = 0
        self.hooks = []
        for bucket in self.buckets:
            for p in bucket.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))

    def _hook(self, bucket: Bucket) -> Any:
        def grad_ready(p: torch.Tensor) -> None:
            self.touched = True
            if self.delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally."
                )
            self.delay[p] -= 1
            if self.delay[p] == 0:
                bucket.ready += 1
                if bucket.ready == len(bucket.params) and self.op != Adasum:
                    self._launch_ready_in_order()

        return grad_ready

    def _layout_signature(self) -> Signature:
        """The buckets as they travel (after compression): what every rank must agree on before a step."""
        tensors = []
        for bucket in self.buckets:
            sent, _ = self.compression.compress(torch.zeros(1, dtype=bucket.buffer.dtype))
            tensors.append(TensorSignature(str(sent.dtype).removeprefix("torch."), (bucket.buffer.numel(),)))
        device = "cuda" if self.buckets and self.buckets[0].buffer.is_cuda else "cpu"
        return Signature("optimizer", tuple(tensors), self.op, -1, self.predivide, 1.0, device)

    def is_member(self) -> bool:
        """A rank outside the optimizer's process set steps on its own gradients, as in Horovod."""
        return bool(self.process_set.included())

    def _agree_on_step(self) -> None:
        """Before the step's first bucket: the ranks agree on the layout (and joined ranks learn it)."""
        if self.next_launch or self.step_error is not None:
            return
        if not self.is_member():
            self.step_error = _NotAMember()
            return
        self.group = process_sets.group_of(self.process_set)
        try:
            self.agreement = agree(self.process_set, self.name, self.signature, may_start_unannounced=self.counts_joins)
        except (RuntimeError, ValueError) as exc:
            self.step_error = exc

    def _launch_ready_in_order(self) -> None:
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._agree_on_step()
            if self.step_error is not None:
                return
            self._launch(bucket)
            self.next_launch += 1

    def gradients(self, bucket: Bucket) -> list[torch.Tensor]:
        """The bucket's gradients, dense: zeros for a parameter that got none, a sparse one made dense (and made
        sparse again after the step's reduction)."""
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                self.sparse.add(p)
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        return grads

    def _launch(self, bucket: Bucket) -> None:
        torch._foreach_copy_(bucket.views, self.gradients(bucket))
        if bucket.control:
            mark_active(bucket.buffer)
        if dist.get_world_size(self.group) == 1:
            return
        sent, bucket.ctx = self.compression.compress(bucket.buffer)
        if self.op == Average and self.predivide != 1.0:
            sent.div_(self.predivide)
        bucket.sent = sent
        try:
            bucket.work = launch(lambda: dist.all_reduce(sent, op=TORCH_OPS[self.op], group=self.group, async_op=True))
        except WorkerInternalError as exc:
            bucket.error = exc

    def synchronize(self) -> None:
        """Finish this step's reduction: every bucket's result lands in its parameters' `.grad`."""
        joined_ranks = None
        try:
            self._agree_on_step()
            if isinstance(self.step_error, _NotAMember):
                return
            if self.step_error is not None:
                raise self.step_error
            for bucket in self.buckets[self.next_launch :]:
                self._launch(bucket)
            self.next_launch = len(self.buckets)
            self.agreement.confirm()
            size = dist.get_world_size(self.group)
            for bucket in self.buckets:
                if bucket.error is not None:
                    raise bucket.error
                if bucket.work is None:
                    continue
                finish(bucket.work, waits_on_stream(bucket.buffer), self.agreement.while_stuck)
                result = self.compression.decompress(bucket.sent, bucket.ctx)
                if bucket.control:
                    joined_ranks = joined_ranks_in(result)
                _copy_scaled(
                    [p.grad for p in bucket.params],
                    bucket.data_of(result),
                    self.predivide / size if self.op == Average else 1.0,
                )
            for p in self.sparse:
                p.grad = p.grad.to_sparse()
        finally:
            self.agreement.end(joined_ranks)
            self.clear()

    def clear(self) -> None:
        for bucket in self.buckets:
            bucket.clear()
        for p in self.delay:
            self.delay[p] = self.backward_passes_per_step
        self.touched = False
        self.next_launch = 0
        self.step_error = None
        self.agreement = StepAgreement()
        self.sparse.clear()
