"""Copies of what holds a process group: `copy.deepcopy` shares the group, pickling refuses.

A process group (and its `dist_ops.Link`) belongs to this process's run: it cannot be copied
or sent elsewhere (``TypeError: cannot pickle 'ProcessGroup' object``). Users copy models in
one process all the time (EMA weights, a frozen teacher, ``trl.create_reference_model``), so
every object of taco_accel that holds a group derives from `SharesGroup`:

- ``copy.deepcopy`` makes a new object whose values are copies, except the process groups
  (and `SharedWithCopies` objects, the groups' links), which the copy shares. A copied model
  therefore runs on the same groups with its own sites (their own handles for the compiled
  graph's custom ops, their own statistics) and its own gradient hooks: `SharesGroup._copied`
  lets a class renew what belongs to one object only.
- pickling (``pickle.dumps``, ``torch.save(model)``) raises `NotPicklableError`, one line that
  says why and what to do instead.

Invariant: a copy never shares mutable state with its original other than the groups, so
training or popping the statistics of one leaves the other as it was.
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from ..errors import NotPicklableError

WHY = ("a tensor-parallel model (and each of its parts) holds the process groups of this run, which exist in this "
       "process only, so it cannot be pickled: save the weights with taco_accel.save_pretrained(model, path) (or "
       "accelerator.save_model) and load them with taco_accel.from_pretrained(path, tp=...); save a training run "
       "with accelerator.save_state; copy.deepcopy(model) copies it within this process")


def _is_group(value) -> bool:
    return isinstance(value, (dist.ProcessGroup, SharedWithCopies))


def _state(obj) -> dict:
    """The attributes of ``obj``: its ``__dict__`` and every set ``__slots__`` entry."""
    state = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                state[name] = getattr(obj, name)
    return state


class SharesGroup:
    """Mixin: `copy.deepcopy` copies every attribute except process groups (shared); pickling
    raises `NotPicklableError`. ``_fresh``: attributes not copied, set by `_copied` instead."""

    __slots__ = ()
    _fresh: tuple[str, ...] = ()

    def __deepcopy__(self, memo: dict):
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = _state(self)
        for value in state.values():
            if _is_group(value):
                memo.setdefault(id(value), value)
        for name, value in state.items():
            if name not in self._fresh:
                object.__setattr__(new, name, copy.deepcopy(value, memo))
        new._copied(self)
        return new

    def _copied(self, original) -> None:
        """Renew on a fresh copy what must not be shared with ``original`` (handles, hooks)."""

    def __reduce_ex__(self, protocol):
        raise NotPicklableError(f"cannot pickle {type(self).__name__}: {WHY}")


class SharedWithCopies:
    """Mixin for an object of a process group itself (its link): copies share it, pickling
    raises `NotPicklableError`."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict):
        return self

    def __reduce_ex__(self, protocol):
        raise NotPicklableError(f"cannot pickle {type(self).__name__}: {WHY}")
