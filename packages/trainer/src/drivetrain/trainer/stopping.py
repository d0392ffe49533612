"""Stopping a run when told to: SIGTERM (what schedulers send before they kill) and SIGINT.

The first signal asks the loop to stop at the next step boundary: the step in progress
finishes, a checkpoint is written there (SIGTERM always; SIGINT when
``run.checkpoint_on_interrupt``) unless that step's checkpoint exists already, and the run
ends with one line saying where it stopped and where ``--resume auto`` continues, and the exit
status schedulers expect (128 + the signal: 143 for SIGTERM, 130 for SIGINT). If that does not
happen within ``run.stop_grace_s`` seconds of the signal, the run is abandoned (the same line,
no new checkpoint): a scheduler's kill would come anyway, and the last checkpoint stands. That
exit flushes stdout and stderr and runs the last words registered with
:func:`drivetrain.trainer.forced_exit.on_forced_exit` (killing child process groups, closing
the metrics), each bounded, then ends with ``os._exit`` and the same status. A second SIGINT
abandons at once.

Under torchrun every rank gets the signal, not necessarily between the same two steps: the
ranks agree (one all-reduce per step) so that all of them stop, and save, at the same step.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from drivetrain.trainer.checkpoints import CheckpointManager
from drivetrain.trainer.errors import RunStopped
from drivetrain.trainer.forced_exit import forced_exit

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The status a process ended by ``signum`` reports in a shell (128 + the signal)."""
    return 128 + signum


def any_rank(flag: bool) -> bool:
    """``flag`` of any rank of this process's group (torchrun); ``flag`` when alone."""
    import torch  # here: the commands import this module, `drivetrain engines` needs no torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@dataclass
class Position:
    """Where a run is: steps done, and the step of its newest checkpoint (the one it resumed
    from or saved last). The same on every rank: each updates it at the same points."""

    checkpoints: CheckpointManager
    done: int = 0
    saved: int | None = None

    def where(self) -> str:
        if self.saved is None:
            return f"{self.done} steps done, no checkpoint: a rerun starts from step 0"
        path = self.checkpoints.step_path(self.saved)
        return f"{self.done} steps done; --resume auto continues from step {self.saved} ({path})"


def stop_here(stop: StopSignals, position: Position, save: Callable[[int], None]) -> RunStopped:
    """At a step boundary after a signal: write this step's checkpoint when the signal wants
    one and it is not there yet; the error that ends the run, saying where."""
    if stop.wants_checkpoint() and position.done > 0 and position.saved != position.done:
        save(position.done)  # updates position.saved
    return stop.stopped(position.where())


def run_signals(run: Any, position: Position, *, agree: bool) -> StopSignals:
    """The stop signals of a run section with ``stop_grace_s`` and ``checkpoint_on_interrupt``
    (SFT, DPO, RL); ``agree``: torchrun ranks, each running the loop."""
    return StopSignals(
        grace_s=run.stop_grace_s,
        checkpoint_on_interrupt=run.checkpoint_on_interrupt,
        where=position.where,
        agree=agree,
    )


class StopSignals:
    """Within ``with``: SIGTERM and SIGINT ask the run to stop (see the module docstring).
    ``where()`` says, at any moment, the step in progress and the checkpoint a resume would take
    (for the line printed when the grace runs out)."""

    def __init__(
        self,
        *,
        grace_s: float,
        checkpoint_on_interrupt: bool,
        where: Callable[[], str],
        agree: bool = False,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.grace_s, self.checkpoint_on_interrupt = grace_s, checkpoint_on_interrupt
        self.where, self.agree = where, agree
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._left = False  # the run left the with: its own end says where it stopped

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # else: signals not ours
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._left = True  # before cancel: a timer already firing then leaves the exit alone
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: abandon now
                self.signum = signum
                raise RunStopped(self._abandoned("a second SIGINT"), exit_status(signum))
            return
        self.signum = signum
        if self.grace_s > 0:
            self._timer = threading.Timer(self.grace_s, self._grace_over)
            self._timer.daemon = True
            self._timer.start()

    def _abandoned(self, why: str) -> str:
        name = signal.Signals(self.signum or signal.SIGTERM).name
        return f"stopped by {name} ({why}), no new checkpoint: {self.where()}"

    def _grace_over(self) -> None:
        """The step and its checkpoint did not end within the grace: say where the run stands,
        run the last words and exit now (:func:`forced_exit`: the process's other threads
        cannot be unwound from here; the last checkpoint stands)."""
        if self._left:
            return
        line = self._abandoned(f"run.stop_grace_s={self.grace_s:g} passed")
        forced_exit(exit_status(self.signum or signal.SIGTERM), lambda: self.say(line))

    def requested(self) -> bool:
        """Whether the run should stop at this step boundary (every rank agrees)."""
        asked = self.signum is not None
        return any_rank(asked) if self.agree else asked

    def wants_checkpoint(self) -> bool:
        return self.signum != signal.SIGINT or self.checkpoint_on_interrupt

    def stopped(self, line: str) -> RunStopped:
        """The error that ends the run at a step boundary, with ``line`` to print."""
        signum = self.signum or signal.SIGTERM
        name = signal.Signals(signum).name
        return RunStopped(f"stopped by {name}: {line}", exit_status(signum))
