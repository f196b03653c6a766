"""Gradient compression for allreduce, with Horovod's contract: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor,
ctx) -> tensor`. `Compression.none` passes tensors through; `Compression.fp16` sends floating tensors as float16.
Any object with those two static methods works as a user compressor."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """The interface: compress returns the tensor to send and what decompress needs to undo it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and come back in their own dtype; other dtypes travel as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if tensor.dtype != ctx else tensor


class Compression:
    """The compressors by name, as `hvd.Compression.none` / `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
