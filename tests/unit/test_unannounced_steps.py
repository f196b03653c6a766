"""When a DistributedOptimizer step may start with no agreement (libworker.joining): only a cached layout, on the
global set, on CPU tensors, while no rank is joined; each such step is numbered like a cycle, and a step whose
control element says a rank served it as joined turns the agreement back on."""

from __future__ import annotations

import torch

from libworker.joining import NoticeBoard, Operations
from libworker.negotiation import Controller
from libworker.signatures import Signature, TensorSignature

LAYOUT = Signature("optimizer", (TensorSignature("float32", (1001,)),), 0)


def _global_set(signature: Signature = LAYOUT) -> Controller:
    board = NoticeBoard(store=None)  # these tests post nothing
    board.close()
    controller = Controller(None, [0, 1], lambda signature: None, Operations(board))
    controller.cache.remember("optimizer.0", signature)
    return controller


def test_a_cached_step_on_the_global_set_is_numbered_and_needs_no_agreement() -> None:
    controller = _global_set()
    controller.operations.count = 7
    assert controller.start_unannounced("optimizer.0", LAYOUT) == 8
    assert controller.operations.waiting_in == {8: "step:optimizer.0"}
    controller.end_unannounced(8, torch.zeros(1))
    assert controller.operations.waiting_in == {} and not controller.join_state.someone_joined
    assert controller.start_unannounced("optimizer.0", LAYOUT) == 9


def test_a_step_a_joined_rank_served_turns_the_agreement_back_on() -> None:
    controller = _global_set()
    operation = controller.start_unannounced("optimizer.0", LAYOUT)
    controller.end_unannounced(operation, torch.ones(1))
    assert controller.join_state.someone_joined
    assert controller.start_unannounced("optimizer.0", LAYOUT) is None


def test_an_uncached_or_changed_layout_a_gpu_step_or_a_process_set_is_agreed_on() -> None:
    assert _global_set().start_unannounced("optimizer.1", LAYOUT) is None
    assert (
        _global_set().start_unannounced(
            "optimizer.0", Signature("optimizer", (TensorSignature("float32", (1002,)),), 0)
        )
        is None
    )
    on_gpu = Signature("optimizer", LAYOUT.tensors, 0, device="cuda")
    assert _global_set(on_gpu).start_unannounced("optimizer.0", on_gpu) is None
    process_set = _global_set()
    process_set.operations.board = None
    assert process_set.start_unannounced("optimizer.0", LAYOUT) is None


def test_a_failed_step_leaves_nothing_to_answer_for() -> None:
    controller = _global_set()
    operation = controller.start_unannounced("optimizer.0", LAYOUT)
    controller.end_unannounced(operation, None)
    assert controller.operations.waiting_in == {} and not controller.join_state.someone_joined
