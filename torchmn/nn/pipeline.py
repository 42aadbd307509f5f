"""Micro-batched pipeline parallelism: one stage per rank, GPipe and 1F1B schedules."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torchmn.communicators import CommunicatorBase
from torchmn.errors import TorchmnTypeError, TorchmnValueError
from torchmn.functions.point_to_point import recv_tensors, send_tensors
from torchmn.nn._parallel_utility import agree_on_arguments
from torchmn.nn._pipeline_utility import ActivationMeter, chunk, differentiable_inputs, grads_of, payload_bytes

SCHEDULES = ("gpipe", "1f1b")
_ACT, _GRAD = 0, 1  # tags: activations go down the pipeline, gradients up


class Pipeline(torch.nn.Module):
    """This rank's stage of a pipeline over ``comm``'s ranks (stage ``i`` on rank ``i``).

    :meth:`train_step` cuts a batch into ``micro_batches`` pieces and runs them through the stages so
    that the stages work at the same time: the first stage takes the inputs, the last one the targets
    and ``loss_fn``. Gradients accumulate in the stage's parameters over the micro-batches, each
    micro-batch's loss weighted by its share of the batch, so they equal the unsplit batch's (for a
    ``loss_fn`` that averages over its micro-batch, as torch's losses do by default).

    - ``schedule="gpipe"``: every micro-batch forward, then every backward; a stage keeps all
      ``micro_batches`` micro-batches' activations.
    - ``schedule="1f1b"``: after a warm-up, one forward then one backward; stage ``i`` of ``p``
      keeps at most ``p - i`` micro-batches' activations.

    With data parallelism, give each stage's replicas their own communicator (``comm.split``) and a
    multi-node optimizer over it with ``backward_passes_per_step=micro_batches``: a training step
    makes one backward pass per micro-batch.

    Args:
        stage: this rank's part of the model.
        comm: the pipeline's communicator; its ranks are the stages, in order.
        micro_batches: how many pieces each batch is cut into (along the first dimension).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        loss_fn: ``loss_fn(output, target)`` on the last stage.

    Raises:
        ValueError: an unknown schedule, or ``micro_batches`` below 1.

    Example::

        >>> pipe = torchmn.nn.Pipeline(stages[comm.rank], comm, micro_batches=4, schedule="1f1b",
        ...                            loss_fn=torch.nn.functional.cross_entropy)
        >>> loss = pipe.train_step(x if comm.rank == 0 else None, target=y if pipe.is_last else None)
        >>> optimizer.step()
    """

    def __init__(self, stage: torch.nn.Module, comm: CommunicatorBase, micro_batches: int = 1,
                 schedule: str = "1f1b", loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None):
        super().__init__()
        if schedule not in SCHEDULES:
            raise TorchmnValueError(f"Pipeline: schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise TorchmnValueError(f"Pipeline: micro_batches must be a positive integer, not {micro_batches!r}")
        self.stage = stage
        self.comm = comm
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.index, self.stages = comm.rank, comm.size
        self.is_first, self.is_last = self.index == 0, self.index == self.stages - 1
        self.meter = ActivationMeter()
        self._agreed = False

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes of activations this stage held for backward at once, over every step so far:
        the tensors saved for backward, parameters excluded, plus the stage's inputs and outputs."""
        return self.meter.peak

    def train_step(self, inputs: Any = None, target: Any = None) -> Optional[torch.Tensor]:
        """Run one batch forward and backward through the pipeline; every stage calls it.

        Args:
            inputs: the batch, on the first stage (a tensor or a tuple of tensors); None elsewhere.
            target: the batch's targets, on the last stage; None elsewhere.

        Returns:
            On the last stage, the batch's loss (detached); None elsewhere.

        Raises:
            ValueError: inputs missing on the first stage, or targets or ``loss_fn`` on the last.
            TypeError: a stage before the last returns something other than a tensor or a tuple (or list) of them.
            CollectiveMismatchError: (first step) the stages were built with different ``micro_batches`` or
                ``schedule``.

        Example::

            >>> optimizer.zero_grad()
            >>> loss = pipe.train_step(x if pipe.is_first else None, target=y if pipe.is_last else None)
            >>> optimizer.step()                  # loss: a tensor on the last stage, None elsewhere
        """
        m = self.micro_batches
        if not self._agreed:
            # Stages cutting the batch into different numbers of pieces, or in another order, would wait
            # for messages that never come, until the timeout: told on every stage at the first step instead.
            agree_on_arguments(self, self.comm, {"micro_batches": m, "schedule": self.schedule})
            self._agreed = True
        if self.is_first and inputs is None:
            raise TorchmnValueError("Pipeline.train_step: the first stage must pass the batch's inputs")
        if self.is_last and (target is None or self.loss_fn is None):
            raise TorchmnValueError("Pipeline.train_step: the last stage needs the targets and a loss_fn")
        self._inputs = chunk(inputs, m) if self.is_first else None
        self._targets = chunk(target, m) if self.is_last else None
        if self.is_last:
            sizes = [len(t) if not isinstance(t, tuple) else len(t[0]) for t in self._targets]
            self._weights = [n / sum(sizes) for n in sizes]
        self._held: dict = {}
        self._loss = None
        if self.schedule == "gpipe":
            for k in range(m):
                self._forward(k)
                self._send_output(k)
            for t in reversed(range(m)):
                self._backward(t, self._receive_grad(t))
        else:
            warmup = min(self.stages - self.index - 1, m)
            for k in range(warmup):
                self._forward(k)
                self._send_output(k)
            for t in range(m - warmup):
                self._forward(warmup + t)
                # The gradient is received before the output is sent: the next stage, at this point of
                # its own schedule, sends that gradient first (blocking sends would otherwise meet).
                grad = self._receive_grad(t)
                self._send_output(warmup + t)
                self._backward(t, grad)
            for t in range(m - warmup, m):
                self._backward(t, self._receive_grad(t))
        loss, self._loss = self._loss, None
        self._inputs = self._targets = None
        return loss

    # ----------------------------------------------------------------------------- one micro-batch
    def _forward(self, k: int) -> None:
        if self.is_first:
            x = self._inputs[k]
        else:
            x = differentiable_inputs(recv_tensors(self.comm, self.index - 1, _ACT))
        with self.meter.recording(k, self.stage.parameters()):
            out = self.stage(*(x if isinstance(x, tuple) else (x,)))
            if self.is_last:
                out = self.loss_fn(out, self._targets[k]) * self._weights[k]
            else:
                out = self._checked_output(out)
        self.meter.hold(k, payload_bytes(x) + payload_bytes(out))
        self._held[k] = (x, out)

    def _checked_output(self, out: Any) -> Any:
        """What a stage before the last returns, as the next stage receives it: a tensor or a tuple."""
        if isinstance(out, list):
            out = tuple(out)
        if not isinstance(out, torch.Tensor) and not (
                isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out)):
            raise TorchmnTypeError(f"Pipeline: stage {self.index}'s output goes to stage {self.index + 1}, so it must be "
                                   f"a tensor or a tuple (or list) of tensors, not {type(out).__name__}; return the "
                                   f"tensors the next stage takes as its arguments")
        return out

    def _send_output(self, k: int) -> None:
        if not self.is_last:
            send_tensors(self.comm, self._held[k][1], self.index + 1, _ACT)

    def _receive_grad(self, t: int):
        return None if self.is_last else recv_tensors(self.comm, self.index + 1, _GRAD)

    def _backward(self, t: int, grad) -> None:
        x, out = self._held.pop(t)
        if self.is_last:
            out.backward()
            self._loss = out.detach() if self._loss is None else self._loss + out.detach()
        else:
            outs = out if isinstance(out, tuple) else (out,)
            grads = grad if isinstance(grad, tuple) else (grad,)
            pairs = [(o, g.to(o.device)) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.meter.release(t)
        if not self.is_first:
            send_tensors(self.comm, grads_of(x), self.index - 1, _GRAD)

    def forward(self, inputs: Any = None) -> Any:
        """Run a batch forward only (evaluation, no micro-batches); every stage calls it.

        Args:
            inputs: the batch on the first stage; None elsewhere.

        Returns:
            The last stage's output on the last stage; None elsewhere.

        Example::

            >>> logits = pipe(x if pipe.is_first else None)     # the last stage's output there, else None
        """
        with torch.no_grad():
            x = inputs if self.is_first else recv_tensors(self.comm, self.index - 1, _ACT)
            out = self.stage(*(x if isinstance(x, tuple) else (x,)))
            if self.is_last:
                return out
            send_tensors(self.comm, self._checked_output(out), self.index + 1, _ACT)
            return None
