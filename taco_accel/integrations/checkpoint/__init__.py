"""Training checkpoints of a pp x dp x tp run: sharded, reshardable, atomic, checksummed, read
without running pickled code.

The one checkpoint format of taco_accel (`Accelerator.save_state` / ``load_state``; the
recipes' ``--save-every`` / ``--resume``). A checkpoint folder holds:

- ``taco_checkpoint.json``, the commit record, replaced last: format and version, the identity
  of the save and of the run, the mesh it was saved from, its data folder, and the size and
  sha256 of every file in it;
- ``taco_state-<save id>/``: a `torch.distributed.checkpoint` (DCP) folder holding every value
  under one name and its full, unsharded shape, each block written once by one of the ranks
  that hold it. ``model.<i>.<transformers name>``: parameters and buffers of prepared model
  i; ``optimizer.<j>.state.<i>.<parameter name>.<key>``: optimizer state (Adam's moments are
  split like their parameter); ``optimizer.<j>.param_groups``; ``rng.pp<p>.dp<d>.tp<t>``: the
  random states of each mesh coordinate; ``shared``: schedulers, the gradient scaler,
  DataLoader positions, registered objects and the step counter;
- whatever else the user keeps there: never read, written or deleted.

**Resharding**: each rank reads the blocks of the full tensors that its own shards cover (a
`ShardSpec` says which rows or columns a TP rank holds, FSDP2's DTensor which part of that),
whichever ranks wrote them, so a run saved at one mesh resumes at any other (pp, dp and tp
sizes, DDP or FSDP2) with the same numbers. Optimizer state is keyed by parameter name, so
pipeline stages may change; the random states of a coordinate the saved mesh lacks are those
of its nearest saved one (same pp and dp, else pp's, else rank 0's).

**Atomic**: a save writes a new data folder (its writer holds an exclusive ``flock`` on its
``.lock`` meanwhile), replaces the commit record in one rename, then deletes the data folder
the old record named. A job killed at any moment leaves the old checkpoint or the new one,
complete; the data folder of a killed save is deleted by a later save of the same folder once
no process holds its lock. Two jobs saving one folder each touch only their own data folder;
the later commit wins.

**Safe and bounded**: a load reads only the files the record lists, inside the checkpoint's own
data folder, each checked first to be a regular file (no symlink, FIFO or device) of the listed
size and checksum; DCP's metadata is unpickled with an allowlist of its own classes, every
other value with ``torch.load(weights_only=True)``. Every rank must load the same save (its
identity is compared). A problem names the file and raises `CheckpointError` on every rank at
once. `latest` skips damaged checkpoints with a warning.

The package by concern: `record` (the commit record, the atomic steps of a save around it and
the checks of a load), `files` (safe reads of regular files, checksums), `storage` (DCP: the
blocks of full tensors, the hashing writer, the allowlisted reader; `write`, `read`),
`state` (what a training run's state becomes in a checkpoint, and back: `save`, `load`),
`collective` (what every rank agrees on).
"""

from .files import describe
from .record import COMMIT, FORMAT, LOCK, VERSION, exists, latest, new_run_identity, prune, read_record, verify
from .state import TrainingState, load, model_weights, save
from .storage import Blocks, open_checkpoint, read, write

__all__ = [
    "Blocks", "COMMIT", "FORMAT", "LOCK", "TrainingState", "VERSION", "describe", "exists", "latest", "load",
    "model_weights", "new_run_identity", "open_checkpoint", "prune", "read", "read_record", "save", "verify", "write",
]
